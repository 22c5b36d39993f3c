package ratelimit

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
)

// hmacHex is the HMAC-SHA256 of the keyer and value under secret, in hex,
// computed here apart from bucketDigest.
func hmacHex(secret, keyer, value string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(keyer + "\x00" + value))
	return hex.EncodeToString(m.Sum(nil))
}

func sha256Hex(keyer, value string) string {
	sum := sha256.Sum256([]byte(keyer + "\x00" + value))
	return hex.EncodeToString(sum[:])
}

// With key_secret, the key_id is an HMAC that only the secret's holders can
// compute; without it, a plain SHA-256 anyone can match against every IPv4
// address.
func TestKeySecretKeysTheKeyID(t *testing.T) {
	useFakeClock(t)
	const secret = "a-secret-of-at-least-16-bytes"
	t.Setenv("TEST_RL_KEY_SECRET", secret)
	for _, tt := range []struct {
		name, config, want string
	}{
		{"none", "", sha256Hex("ip/32/64", "127.0.0.2")[:16]},
		{"literal", "key_secret " + secret, hmacHex(secret, "ip/32/64", "127.0.0.2")[:16]},
		{"env", "key_secret {env.TEST_RL_KEY_SECRET}", hmacHex(secret, "ip/32/64", "127.0.0.2")[:16]},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := serve(t, fmt.Sprintf(`
	rate_limit 5 1/s {
		%s
	}
	respond "{http.rate_limit.key_id}"`, tt.config))
			if r := s.from("127.0.0.2", "/"); r.body != tt.want {
				t.Errorf("key_id %q, want %q", r.body, tt.want)
			}
		})
	}
}

// The Redis key is built from the same keyed digest: nothing in Redis can be
// matched against a list of candidate values without the secret.
func TestKeySecretKeysTheRedisKey(t *testing.T) {
	useFakeClock(t)
	const secret = "another-secret-16-bytes-or-more"
	srv := startRedis(t)
	s := serve(t, fmt.Sprintf(`
	rate_limit 5 1/s {
		key_secret %s
		store redis {
			address %s
		}
	}
	respond "ok"`, secret, srv.url()))
	if r := s.from("127.0.0.2", "/"); r.status != 200 {
		t.Fatalf("status %d", r.status)
	}
	keys, _ := srv.do("KEYS", "*").([]any)
	if len(keys) != 1 {
		t.Fatalf("Redis holds %d keys, want 1: %v", len(keys), keys)
	}
	key := keys[0].(string)
	if want := hmacHex(secret, "ip/32/64", "127.0.0.2")[:32]; !strings.Contains(key, want) {
		t.Errorf("Redis key %q does not hold the keyed digest %s", key, want)
	}
	if plain := sha256Hex("ip/32/64", "127.0.0.2")[:32]; strings.Contains(key, plain) {
		t.Errorf("Redis key %q holds the unkeyed digest, which anyone can reverse", key)
	}
}

func TestKeySecretMistakes(t *testing.T) {
	t.Setenv("TEST_RL_SHORT_SECRET", "short")
	for _, tt := range []struct{ config, want string }{
		{"key_secret tooshort", "key_secret: the value given is 8 bytes long; want at least 16"},
		{"key_secret {env.TEST_RL_SHORT_SECRET}", `key_secret: "{env.TEST_RL_SHORT_SECRET}" is 5 bytes long`},
		{"key_secret {env.TEST_RL_UNSET_SECRET}", `key_secret: "{env.TEST_RL_UNSET_SECRET}" is 0 bytes long`},
	} {
		cfg, err := adaptCaddyfile(fmt.Sprintf("{\n\tadmin off\n}\nhttp://127.0.0.1:%d {\n\trate_limit 5 1/s {\n\t\t%s\n\t}\n}\n", freePort(t), tt.config))
		if err == nil {
			err = loadAndStop(cfg)
		}
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: error %v, want one containing %q", tt.config, err, tt.want)
		}
		if err != nil && strings.Contains(err.Error(), "short\"") {
			t.Errorf("%s: the error shows the secret: %v", tt.config, err)
		}
	}
}
