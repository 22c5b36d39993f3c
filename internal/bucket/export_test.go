package bucket

// Internals that the tests (package bucket_test, which holds the package
// to buckettest's models) reach.

// MaxUnits bounds Capacity*Rate.Interval.
const MaxUnits = maxUnits

// MaxDeficit is how far below empty a charge may take a bucket of l.
func (l Limit) MaxDeficit() int64 { return l.maxDeficit() }

// UsedIn is the count in the period starting at start.
func (s QuotaState) UsedIn(start int64) int64 { return s.used(start) }

// PeekRefused reports the limits of a request a quota refused.
var PeekRefused = peekRefused
