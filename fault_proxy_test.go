package ratelimit

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// blackholeProxy stands between a client and a redis-server on loopback.
// Dark, it still accepts connections but forwards nothing either way, as a
// silent network does; lit again, new traffic flows. Bytes it dropped stay
// dropped, so a connection that was in use while dark is out of step, as
// after a real outage.
type blackholeProxy struct {
	ln     net.Listener
	target string
	dark   atomic.Bool

	mu    sync.Mutex
	conns []net.Conn
}

func startBlackholeProxy(t testing.TB, target string) *blackholeProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &blackholeProxy{ln: ln, target: target}
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *blackholeProxy) addr() string { return p.ln.Addr().String() }

// blackhole stops the link; restore starts it again.
func (p *blackholeProxy) blackhole() { p.dark.Store(true) }
func (p *blackholeProxy) restore()   { p.dark.Store(false) }

func (p *blackholeProxy) accept() {
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			down.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, down, up)
		p.mu.Unlock()
		go p.pipe(up, down)
		go p.pipe(down, up)
	}
}

// pipe copies src to dst, dropping what it reads while the proxy is dark.
func (p *blackholeProxy) pipe(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.dark.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *blackholeProxy) close() {
	p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
}
