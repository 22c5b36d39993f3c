package bucket

// Fleet leases (docs/fleet.md): a node takes several tokens of a
// shared bucket at once and spends them on its own. The shared bucket
// counts what is out on lease, and its level never refills over it, so
// that the fleet admits no more than one bucket would. These are the
// terms of one lease call; the Redis script (internal/redisbucket)
// applies it, and buckettest.Shared is its model.

// LeaseAsk is one node's lease call.
type LeaseAsk struct {
	Node string
	Seq  int64
	// Held is what the node still holds of its earlier leases.
	Held int64
	// Cost is the cost of the request that needs the lease; Want the
	// tokens the node asks for, at least Cost.
	Cost, Want int64
	// Spend is what the node spends of the grant at once, and so does not
	// hold: the cost of the request waiting on the call, 0 for a
	// prefetch.
	Spend int64
	// Prefetch marks a call made in the background, for no request: its
	// refusal refuses nobody, so it starts no ban.
	Prefetch bool
	// Hold is how long the record lives (µs): lease_ttl plus timeout, so
	// that a give-back sent at lease_ttl arrives before it expires.
	Hold int64
}

// LeaseResult is what one lease call decided for a node.
type LeaseResult struct {
	// Granted is the whole tokens the node took; 0 when refused.
	Granted int64
	// Remaining is the whole tokens left in the shared bucket (the least
	// of its limits).
	Remaining int64
	// RetryAfter is the microseconds until the shared bucket holds the
	// cost; 0 when it does. While a ban holds a tier with max_wait, it is
	// until a request of the cost would go on within max_wait, as strict
	// mode answers it.
	RetryAfter int64
	// HoldOff is, when nothing was granted, or fewer tokens than asked for
	// and the shared bucket's limits cannot cover a request's cost, the
	// microseconds until they hold the tokens asked for (after a ban: the
	// cost); 0 otherwise. QuotaHold is the same for its quotas:
	// until the end of the period of a quota that lacks them. The node
	// holds its calls off for the first, and for the second no longer
	// than a while, since a give-back elsewhere may return a quota early.
	HoldOff   int64
	QuotaHold int64
	// LimitRetry is RetryAfter for the limits alone: a ban's hold, say,
	// without a quota's.
	LimitRetry int64
	// ResetAfter is the microseconds until the shared bucket is full again.
	ResetAfter int64
	// Banned says that this refusal started a ban.
	Banned bool
	// Drop says that a ban started since the node's last call, or that
	// what it holds was counted in a quota period that has ended: it must
	// drop what it holds.
	Drop bool
	// Void says that the node's record holds tokens a ban voided: the node
	// gives back (Return) what it did not spend of them, so that the
	// quotas count only what it admitted. When the bucket would grant,
	// nothing is granted (Granted and RetryAfter are 0): the node asks
	// again once its give-back is in.
	Void bool
	// BanHolds says that a ban holds the bucket empty: requests are
	// refused until RetryAfter, and starting another is moot.
	BanHolds bool
	// Until, with quotas, is the microseconds until the end of the quota
	// period that counted the tokens: the node may not spend them after.
	// 0 without quotas.
	Until int64
}
