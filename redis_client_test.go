package ratelimit

import (
	"net"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// silentListener accepts TCP connections on loopback and never says a
// word, so a TLS handshake with it never completes. For each connection it
// reports how long the client held it before giving up.
func silentListener(t *testing.T) (addr string, held <-chan time.Duration) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan time.Duration, 100)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				start := time.Now()
				_, _ = c.Read(make([]byte, 4096)) // the ClientHello
				for {
					if _, err := c.Read(make([]byte, 4096)); err != nil {
						select {
						case out <- time.Since(start):
						default:
						}
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return ln.Addr().String(), out
}

// TestRedisTLSDialsEndWithinTheTimeout points each kind of client at a
// server that accepts TCP and never completes the TLS handshake. The
// decision fails within about the timeout, and so does the dial: the
// client hangs up on the handshake instead of holding it, and a dial
// slot, for go-redis's 5 s.
func TestRedisTLSDialsEndWithinTheTimeout(t *testing.T) {
	const timeout = 200 * time.Millisecond
	const slack = 500 * time.Millisecond
	tlsOn := &RedisTLS{InsecureSkipVerify: true}
	for _, c := range []struct {
		name  string
		store func(addr string) *RedisStore
	}{
		{"single node", func(addr string) *RedisStore {
			return &RedisStore{Addresses: []string{addr}, TLS: tlsOn}
		}},
		{"Sentinel", func(addr string) *RedisStore {
			return &RedisStore{Sentinel: &RedisSentinel{Master: "rlmaster", Addresses: []string{addr}}, TLS: tlsOn}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			addr, held := silentListener(t)
			s := c.store(addr)
			s.Timeout = caddy.Duration(timeout)
			s = newPrivateRedisStore(t, s)
			start := time.Now()
			if _, err := takeLimit(bg, s, bucketFor("tls-dial"), slowLimit(1), 1); err == nil {
				t.Fatal("take through a TLS handshake that never ends: no error")
			}
			if took := time.Since(start); took > timeout+slack {
				t.Fatalf("the decision took %s, timeout %s", took, timeout)
			}
			select {
			case d := <-held:
				if d > timeout+slack {
					t.Fatalf("the client held the unfinished handshake for %s, timeout %s", d, timeout)
				}
			case <-time.After(timeout + slack):
				t.Fatalf("the client still holds the unfinished handshake %s after the decision began, timeout %s", time.Since(start), timeout)
			}
		})
	}
}
