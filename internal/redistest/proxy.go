package redistest

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy stands between a client and a redis-server on loopback, and
// plays the network between them:
//   - delay: every byte is forwarded a fixed time after it was read, in
//     each direction, as a distant Redis would answer. Bytes in flight do
//     not wait for each other, so pipelined calls overlap as on a real link.
//   - blackhole: connections are still accepted but nothing is forwarded
//     either way, as a silent network does; restore starts traffic again.
//     Bytes dropped stay dropped, so a connection that was in use while
//     dark is out of step, as after a real outage.
//   - cut: every open connection is closed and new ones are closed as soon
//     as they are accepted, as a Redis that was killed looks to its
//     clients; restore lets new connections through again.
type Proxy struct {
	ln     net.Listener
	target string
	delay  time.Duration
	dark   atomic.Bool
	down   atomic.Bool

	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func StartProxy(t testing.TB, target string, delay time.Duration) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{ln: ln, target: target, delay: delay, conns: map[net.Conn]struct{}{}}
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is where clients reach the proxy.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Delay is the time each byte takes, in each direction.
func (p *Proxy) Delay() time.Duration { return p.delay }

// Blackhole silences the link; Cut closes it; Restore undoes either.
func (p *Proxy) Blackhole() { p.dark.Store(true) }
func (p *Proxy) Restore()   { p.dark.Store(false); p.down.Store(false) }

func (p *Proxy) Cut() {
	p.down.Store(true)
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
	}
}

func (p *Proxy) accept() {
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.down.Load() {
			down.Close()
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			down.Close()
			continue
		}
		p.mu.Lock()
		p.conns[down], p.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		go p.pipe(up, down)
		go p.pipe(down, up)
	}
}

// chunk is bytes read from one side, due on the other at a time.
type chunk struct {
	data []byte
	due  time.Time
}

// pipe copies src to dst, delayed, dropping what it reads while the proxy
// is dark.
func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.forget(src)
	queue := make(chan chunk, 4096)
	go p.send(dst, queue)
	defer close(queue)
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.dark.Load() {
			queue <- chunk{data: append([]byte(nil), buf[:n]...), due: time.Now().Add(p.delay)}
		}
		if err != nil {
			return
		}
	}
}

// send writes each chunk to dst when it is due, and closes dst after the
// last one.
func (p *Proxy) send(dst net.Conn, queue <-chan chunk) {
	defer p.forget(dst)
	for c := range queue {
		time.Sleep(time.Until(c.due))
		if _, err := dst.Write(c.data); err != nil {
			for range queue {
			}
			return
		}
	}
}

func (p *Proxy) forget(c net.Conn) {
	c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *Proxy) close() {
	p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
}
