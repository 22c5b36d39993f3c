package ratelimit

import (
	"context"
	"fmt"
	"hash/maphash"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/localbucket"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(LocalStore{})
}

// LocalStore keeps buckets in this process's memory. It is the default
// store. Buckets survive config reloads, for as long as some loaded config
// uses the policy.
type LocalStore struct {
	// MaxKeys bounds how many buckets the policy keeps. When a new client
	// arrives at the bound, buckets that have refilled to full are dropped
	// first (which loses nothing), then others. Default 1000000.
	MaxKeys int `json:"max_keys,omitempty"`

	buckets *localbucket.Store
	key     string
}

// CaddyModule returns the Caddy module information.
func (LocalStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.local",
		New: func() caddy.Module { return new(LocalStore) },
	}
}

const defaultMaxKeys = 1000000

// Validate checks the configuration.
func (s *LocalStore) Validate() error {
	if s.MaxKeys < 0 {
		return fmt.Errorf("store local: max_keys %d: must be at least 1", s.MaxKeys)
	}
	return nil
}

func (s *LocalStore) maxKeys() int {
	if s.MaxKeys == 0 {
		return defaultMaxKeys
	}
	return s.MaxKeys
}

// localPool holds one bucket table per policy, across config reloads.
var localPool = caddy.NewUsagePool()

func (s *LocalStore) bind(policy string) error {
	if err := s.Validate(); err != nil {
		return err
	}
	s.key = "local/" + policy
	val, loaded, err := localPool.LoadOrNew(s.key, func() (caddy.Destructor, error) {
		return localbucket.New(localOptions(s.maxKeys())), nil
	})
	if err != nil {
		return err
	}
	s.buckets = val.(*localbucket.Store)
	if loaded {
		s.buckets.SetMaxKeys(s.maxKeys())
	}
	return nil
}

// Cleanup releases this config's hold on the policy's buckets.
func (s *LocalStore) Cleanup() error {
	if s.key == "" {
		return nil
	}
	// Idempotent: a config's Cleanup may reach a store more than once.
	_, err := localPool.Delete(s.key)
	s.key = ""
	return err
}

func (s *LocalStore) take(_ context.Context, b *Bucket, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error) {
	return s.buckets.Take(localID(b), tr, cost, out), nil
}

func (s *LocalStore) peek(_ context.Context, b *Bucket, tr bucket.Tier, out []bucket.Result) error {
	s.buckets.Peek(localID(b), tr, out)
	return nil
}

func (s *LocalStore) giveBack(_ context.Context, b *Bucket, tr bucket.Tier, limitsN, n, at int64) error {
	s.buckets.GiveBack(localID(b), tr, limitsN, n, at)
	return nil
}

func (s *LocalStore) charge(_ context.Context, b *Bucket, tr bucket.Tier, n int64) error {
	s.buckets.Charge(localID(b), tr, n)
	return nil
}

func (s *LocalStore) reset(_ context.Context, b *Bucket) error {
	s.buckets.Reset(localID(b))
	return nil
}

// acquire counts the slot beside the policy's buckets, under the same
// shard lock, only while requests are in flight.
func (s *LocalStore) acquire(_ context.Context, b *Bucket, n int64) (uint64, int64, bool, error) {
	inUse, ok := s.buckets.Acquire(localID(b), n)
	return 0, inUse, ok, nil
}

func (s *LocalStore) release(b *Bucket, _ uint64) { s.buckets.Release(localID(b)) }

func (s *LocalStore) inFlight(_ context.Context, b *Bucket) (int64, error) {
	return s.buckets.InFlight(localID(b)), nil
}

// report's keys are the live buckets.
func (s *LocalStore) report() storeReport { return storeReport{keys: s.buckets.Live()} }

// UnmarshalCaddyfile sets up the store from Caddyfile tokens:
//
//	store local {
//	    max_keys <n>
//	}
func (s *LocalStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // "local"
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "max_keys":
			n, err := intArg(d)
			if err != nil {
				return err
			}
			if n < 1 {
				return d.Errf("max_keys %d: must be at least 1", n)
			}
			s.MaxKeys = int(n)
		default:
			return d.Errf("store local: unknown subdirective %q", d.Val())
		}
	}
	return nil
}

// localClock is the clock that new local stores read, and localWallClock
// their wall clock, for quotas. Tests replace them before they load a
// config.
var (
	localClock     = monotonicMicros
	localWallClock = func() int64 { return time.Now().UnixMicro() }
)

// localOptions are the engine's settings for a store of maxKeys.
func localOptions(maxKeys int) localbucket.Options {
	return localbucket.Options{MaxKeys: maxKeys, Now: localClock, Wall: localWallClock, Evictions: &evictionsTotal}
}

// hashSeed keys the local hash, so clients cannot aim for collisions.
var hashSeed = maphash.MakeSeed()

// localID is the engine's id of a bucket: a keyed hash of its whole name.
func localID(b *Bucket) uint64 {
	var h maphash.Hash
	h.SetSeed(hashSeed)
	h.WriteString(b.Policy)
	h.WriteByte(0)
	h.WriteString(b.Tier)
	h.WriteByte(0)
	h.WriteString(b.Keyer)
	h.WriteByte(0)
	h.Write(b.Value)
	return h.Sum64()
}

// Interface guards
var (
	_ policyStore           = (*LocalStore)(nil)
	_ reporter              = (*LocalStore)(nil)
	_ caddy.Validator       = (*LocalStore)(nil)
	_ caddy.CleanerUpper    = (*LocalStore)(nil)
	_ caddyfile.Unmarshaler = (*LocalStore)(nil)
)
