package draftwise

import (
	"context"
	"io"
	"time"

	pb "github.com/draftwise/draftwise/clients/go/draftwisev1"
	"google.golang.org/grpc/codes"
)

// Stream is one request on GenerateStream. Recv returns its events (deltas, then the
// finished event) and io.EOF after the finished event. Should the connection drop after the
// first delta, Recv reconnects and resumes the request with its resume handle: the caller
// sees one uninterrupted stream, no gap, no duplicate.
type Stream struct {
	c        *Client
	ctx      context.Context
	call     pb.GenerateService_GenerateStreamClient
	cancel   context.CancelFunc
	prog     progress
	attempts int
	resumes  int
	done     bool
}

// Stream starts req on GenerateStream.
func (c *Client) Stream(ctx context.Context, req Request) (*Stream, error) {
	s := &Stream{c: c, ctx: ctx, prog: progress{requestID: req.ID}}
	if err := s.open(&pb.GenerateStreamRequest{Start: req.start()}); err != nil {
		return nil, err
	}
	return s, nil
}

// Resume reattaches to a request whose call went away, on a new GenerateStream call: the
// events from nextIndex on (the first token index the caller has not received), then the
// rest live. An unknown handle or one whose retention passed ends NOT_FOUND.
func (c *Client) Resume(ctx context.Context, handle string, nextIndex uint32) (*Stream, error) {
	s := &Stream{c: c, ctx: ctx, prog: progress{handle: handle, next: nextIndex}}
	if err := s.open(s.resumeRequest()); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Stream) resumeRequest() *pb.GenerateStreamRequest {
	return &pb.GenerateStreamRequest{Resume: &pb.ResumeGeneration{ResumeHandle: s.prog.handle, NextTokenIndex: s.prog.next}}
}

func (s *Stream) open(req *pb.GenerateStreamRequest) error {
	ctx, cancel := context.WithCancel(s.c.outgoing(s.ctx))
	call, err := s.c.stub.GenerateStream(ctx, req)
	if err != nil {
		cancel()
		return statusError(err, s.prog.requestID)
	}
	s.call, s.cancel = call, cancel
	return nil
}

// Recv returns the request's next event: a delta (GetDelta) or the finished event
// (GetFinished), then io.EOF. A failure is an *Error.
func (s *Stream) Recv() (*pb.GenerationEvent, error) {
	for {
		if s.done {
			return nil, io.EOF
		}
		resp, err := s.call.Recv()
		if err == nil {
			ev := resp.GetEvent()
			if s.prog.requestID == "" {
				s.prog.requestID = ev.GetRequestId()
			}
			keep, perr := s.prog.accept(ev)
			if perr != nil {
				s.finish()
				return nil, perr
			}
			if !keep {
				continue
			}
			s.attempts = 0
			if ev.GetFinished() != nil {
				s.finish()
			}
			return ev, nil
		}
		if err == io.EOF {
			s.finish()
			return nil, &Error{Code: codes.Unavailable, Message: "the call ended without a finished event", RequestID: s.prog.requestID, Resumes: s.resumes}
		}
		e := statusError(err, s.prog.requestID)
		e.Resumes = s.resumes
		policy := s.c.resume
		if s.prog.handle == "" || !isTransport(e) || s.attempts >= policy.MaxAttempts || s.ctx.Err() != nil {
			s.finish()
			return nil, e
		}
		s.attempts++
		s.cancel()
		select {
		case <-time.After(policy.delay(s.attempts)):
		case <-s.ctx.Done():
			s.finish()
			return nil, statusError(s.ctx.Err(), s.prog.requestID)
		}
		s.resumes++
		if oerr := s.open(s.resumeRequest()); oerr != nil {
			s.finish()
			return nil, oerr
		}
	}
}

func (s *Stream) finish() {
	s.done = true
	if s.cancel != nil {
		s.cancel()
	}
}

// Close ends the call. A request that already sent its first delta keeps running on the
// server for its resume retention time: Resume(ResumeHandle(), NextIndex()) reattaches.
func (s *Stream) Close() { s.finish() }

// RequestID is the request's id (chosen by the server when the Request had none).
func (s *Stream) RequestID() string { return s.prog.requestID }

// ResumeHandle is the request's resume handle ("" before its first delta).
func (s *Stream) ResumeHandle() string { return s.prog.handle }

// NextIndex is the index of the first output token not yet received.
func (s *Stream) NextIndex() uint32 { return s.prog.next }

// Resumes counts the resumes Recv sent.
func (s *Stream) Resumes() int { return s.resumes }

// Completion is a whole request's result.
type Completion struct {
	RequestID string
	Text      string
	TokenIDs  []uint32
	Finished  *pb.Finished
	// Deltas are the (first_token_index, token count) of each delta received.
	Deltas [][2]uint32
}

// EventSource is what Collect reads: a Stream or a Session's RequestStream.
type EventSource interface {
	Recv() (*pb.GenerationEvent, error)
}

// Collect reads src to its end into a Completion.
func Collect(src EventSource) (*Completion, error) {
	out := &Completion{}
	for {
		ev, err := src.Recv()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out.RequestID = ev.GetRequestId()
		if d := ev.GetDelta(); d != nil {
			out.Text += d.GetText()
			out.TokenIDs = append(out.TokenIDs, d.GetTokenIds()...)
			out.Deltas = append(out.Deltas, [2]uint32{d.GetFirstTokenIndex(), uint32(len(d.GetTokenIds()))})
		}
		if f := ev.GetFinished(); f != nil {
			out.Finished = f
		}
	}
}

// Complete runs req on GenerateStream and returns its whole result.
func (c *Client) Complete(ctx context.Context, req Request) (*Completion, error) {
	s, err := c.Stream(ctx, req)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return Collect(s)
}
