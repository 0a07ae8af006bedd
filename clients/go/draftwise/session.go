package draftwise

import (
	"context"
	"fmt"
	"io"
	"sync"

	pb "github.com/draftwise/draftwise/clients/go/draftwisev1"
	"google.golang.org/grpc/codes"
)

// Session is one Generate call: many requests multiplexed on one bidirectional stream, each
// with its own id, cancellable on its own; a per-request error ends that request only.
// A goroutine reads the call and hands each event to its request's RequestStream.
type Session struct {
	c      *Client
	call   pb.GenerateService_GenerateClient
	cancel context.CancelFunc
	sendMu sync.Mutex
	mu     sync.Mutex
	reqs   map[string]*RequestStream
	err    error
	done   chan struct{}
}

// Session opens a Generate stream. Close (or cancelling ctx) ends it.
func (c *Client) Session(ctx context.Context) (*Session, error) {
	ctx, cancel := context.WithCancel(c.outgoing(ctx))
	call, err := c.stub.Generate(ctx)
	if err != nil {
		cancel()
		return nil, statusError(err, "")
	}
	s := &Session{c: c, call: call, cancel: cancel, reqs: map[string]*RequestStream{}, done: make(chan struct{})}
	go s.receive()
	return s, nil
}

func (s *Session) receive() {
	defer close(s.done)
	for {
		resp, err := s.call.Recv()
		if err != nil {
			var e error = io.EOF
			if err != io.EOF {
				e = statusError(err, "")
			}
			s.mu.Lock()
			s.err = e
			for id, r := range s.reqs {
				if e == io.EOF { // the call ended OK with this request unfinished
					r.q.push(nil, &Error{Code: codes.Unavailable, Message: "the stream ended without a final event", RequestID: id})
				} else {
					re := *e.(*Error)
					re.RequestID = id
					r.q.push(nil, &re)
				}
				delete(s.reqs, id)
			}
			s.mu.Unlock()
			return
		}
		ev := resp.GetEvent()
		s.mu.Lock()
		r := s.reqs[ev.GetRequestId()]
		final := ev.GetFinished() != nil || ev.GetError() != nil
		if r != nil && final {
			delete(s.reqs, ev.GetRequestId())
		}
		s.mu.Unlock()
		if r != nil {
			r.q.push(ev, nil)
		}
	}
}

func (s *Session) register(id string) (*RequestStream, error) {
	if id == "" {
		return nil, &Error{Code: codes.InvalidArgument, Message: "a session request needs an id"}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, fmt.Errorf("draftwise: the session has ended: %w", s.err)
	}
	if _, taken := s.reqs[id]; taken {
		return nil, &Error{Code: codes.InvalidArgument, Message: fmt.Sprintf("request id %q is already in flight on this session", id), RequestID: id}
	}
	r := &RequestStream{ID: id, s: s, q: newQueue(), prog: progress{requestID: id}}
	s.reqs[id] = r
	return r, nil
}

func (s *Session) send(req *pb.GenerateRequest) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	if err := s.call.Send(req); err != nil {
		if err == io.EOF { // the call is over: its status says why
			<-s.done
			if s.err != nil && s.err != io.EOF {
				return s.err
			}
		}
		return statusError(err, "")
	}
	return nil
}

func (s *Session) unregister(id string) {
	s.mu.Lock()
	delete(s.reqs, id)
	s.mu.Unlock()
}

// Start sends req (whose ID must be set and unique among the session's in-flight requests).
func (s *Session) Start(req Request) (*RequestStream, error) {
	r, err := s.register(req.ID)
	if err != nil {
		return nil, err
	}
	if err := s.send(&pb.GenerateRequest{Action: &pb.GenerateRequest_Start{Start: req.start()}}); err != nil {
		s.unregister(req.ID)
		return nil, err
	}
	return r, nil
}

// Resume reattaches a request started on a call that went away (its resume handle, and the
// first token index not yet received) to this session, under the id id.
func (s *Session) Resume(handle string, nextIndex uint32, id string) (*RequestStream, error) {
	r, err := s.register(id)
	if err != nil {
		return nil, err
	}
	r.prog.handle, r.prog.next = handle, nextIndex
	msg := &pb.ResumeGeneration{ResumeHandle: handle, NextTokenIndex: nextIndex, RequestId: id}
	if err := s.send(&pb.GenerateRequest{Action: &pb.GenerateRequest_Resume{Resume: msg}}); err != nil {
		s.unregister(id)
		return nil, err
	}
	return r, nil
}

// CloseSend half-closes: the in-flight requests finish, then the call ends OK.
func (s *Session) CloseSend() error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	return s.call.CloseSend()
}

// Close cancels the call: requests that already sent a delta stay resumable on the server
// for its retention time; the others are aborted.
func (s *Session) Close() {
	s.cancel()
	<-s.done
}

// Wait blocks until the call has ended (after CloseSend, once every request finished).
func (s *Session) Wait() error {
	<-s.done
	if s.err == io.EOF {
		return nil
	}
	return s.err
}

// RequestStream is one request of a Session.
type RequestStream struct {
	ID   string
	s    *Session
	q    *queue
	prog progress
	done bool
}

// Recv returns the request's next event (deltas, then the finished event) and io.EOF after
// it; a per-request error event is returned as an *Error (final).
func (r *RequestStream) Recv() (*pb.GenerationEvent, error) {
	for {
		if r.done {
			return nil, io.EOF
		}
		ev, err := r.q.pop()
		if err != nil {
			r.done = true
			return nil, err
		}
		if ev.GetError() != nil {
			r.done = true
			return nil, eventError(ev)
		}
		keep, perr := r.prog.accept(ev)
		if perr != nil {
			r.done = true
			return nil, perr
		}
		if !keep {
			continue
		}
		if ev.GetFinished() != nil {
			r.done = true
		}
		return ev, nil
	}
}

// Cancel asks the server to stop the request: its final event is then finished with
// FINISH_REASON_ABORT (and the usage known then).
func (r *RequestStream) Cancel() error {
	return r.s.send(&pb.GenerateRequest{Action: &pb.GenerateRequest_Cancel{Cancel: &pb.CancelGeneration{RequestId: r.ID}}})
}

// ResumeHandle is the request's resume handle ("" before its first delta).
func (r *RequestStream) ResumeHandle() string { return r.prog.handle }

// NextIndex is the index of the first output token not yet received.
func (r *RequestStream) NextIndex() uint32 { return r.prog.next }

// queue is an unbounded FIFO between the session's reader and one request's Recv, so that
// a request nobody reads never stalls the others.
type queue struct {
	mu    sync.Mutex
	items []item
	wake  chan struct{}
}

type item struct {
	ev  *pb.GenerationEvent
	err error
}

func newQueue() *queue { return &queue{wake: make(chan struct{}, 1)} }

func (q *queue) push(ev *pb.GenerationEvent, err error) {
	q.mu.Lock()
	q.items = append(q.items, item{ev, err})
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *queue) pop() (*pb.GenerationEvent, error) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			it := q.items[0]
			q.items = q.items[1:]
			q.mu.Unlock()
			return it.ev, it.err
		}
		q.mu.Unlock()
		<-q.wake
	}
}
