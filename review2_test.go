package ratelimit

import (
	"testing"
)

// The second review's test of what a give-back looks up: the tier of the
// handler that took the tokens, not of another route of the policy.

// "Handlers with the same name share buckets, so one limit can span
// several routes or sites" (README, `name`). The fix that counts a
// give-back in the running config's limit looks the tier up in the last
// handler registered under the policy's name, not in the handler that took
// the tokens: when another route of the same policy, loaded after it, has
// no such tier, the give-back is dropped as if a reload had removed the
// tier. A login route of policy `site` with a tier `login` (3 an hour,
// count_status 401) and the site's catch-all route of the same policy
// without it: every right password costs a token, and the fourth is
// refused, in a config that was never reloaded.
func TestReview2GiveBackIsDroppedWhenAnotherRouteOfThePolicyLacksTheTier(t *testing.T) {
	// The control: the catch-all route under another policy name.
	for _, other := range []string{"other", "site"} {
		t.Run("catch-all policy "+other, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, `
	handle /login {
		rate_limit 100 10/s {
			name site
			key header X-User
			count_status 401
			tier login 3 1/h {
				match {
					path /login
				}
			}
		}
		@wrong header X-Password wrong
		respond @wrong "wrong password" 401
		respond "welcome"
	}
	handle {
		rate_limit 100 10/s {
			name `+other+`
			key header X-User
		}
		respond "ok"
	}`)
			for i := range 10 {
				if r := s.get("/login", "X-User: ann", "X-Password: right"); r.status != 200 {
					t.Fatalf("right password %d at /login: %d, want 200: successes are given back (count_status 401)", i+1, r.status)
				}
			}
		})
	}
}
