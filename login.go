package ratelimit

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Protecting logins (README: count_status and ban): count_status keeps the
// tokens of the responses that count, such as 401, and gives the others
// back; ban holds a denied client off for a while (the bucket math is in
// bucket.go).

// statusSet is a set of response statuses, 100 to 599.
type statusSet [600]bool

// parseStatusSet reads codes ("401") and classes ("4xx").
func parseStatusSet(list []string) (*statusSet, error) {
	set := new(statusSet)
	for _, s := range list {
		if len(s) == 3 && s[0] >= '1' && s[0] <= '5' && (s[1:] == "xx" || s[1:] == "XX") {
			lo := int(s[0]-'0') * 100
			for c := lo; c < lo+100; c++ {
				set[c] = true
			}
			continue
		}
		code, err := strconv.Atoi(s)
		if err != nil || code < 100 || code > 599 {
			return nil, fmt.Errorf("count_status %q: want a status code from 100 to 599, such as 401, or a class such as 4xx", s)
		}
		set[code] = true
	}
	return set, nil
}

// checkLogin checks count_status and ban: the set of statuses that count
// (nil: every one), and the ban in µs.
func checkLogin(countStatus []string, ban caddy.Duration) (*statusSet, int64, error) {
	var counted *statusSet
	if countStatus != nil {
		if len(countStatus) == 0 {
			return nil, 0, errors.New("count_status: give one or more status codes or classes, such as 401 or 4xx")
		}
		set, err := parseStatusSet(countStatus)
		if err != nil {
			return nil, 0, err
		}
		counted = set
	}
	if ban < 0 {
		return nil, 0, fmt.Errorf("ban %s: must be above 0", time.Duration(ban))
	}
	return counted, time.Duration(ban).Microseconds(), nil
}
