package ratelimit

import (
	"errors"
	"fmt"
	"strconv"
	"time"
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

// validateLogin checks count_status and ban, and hands the ban to the
// tiers' limits.
func (h *Handler) validateLogin() error {
	if h.CountStatus != nil {
		if len(h.CountStatus) == 0 {
			return errors.New("count_status: give one or more status codes or classes, such as 401 or 4xx")
		}
		set, err := parseStatusSet(h.CountStatus)
		if err != nil {
			return err
		}
		h.counted = set
	}
	if h.Ban < 0 {
		return fmt.Errorf("ban %s: must be above 0", time.Duration(h.Ban))
	}
	for _, t := range h.Tiers {
		t.ban = time.Duration(h.Ban).Microseconds()
	}
	return nil
}
