package draftwise

import (
	"fmt"
	"strings"
	"time"

	pb "github.com/draftwise/draftwise/clients/go/draftwisev1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error is a request that failed: the call's gRPC status, or a per-request error event on a
// Session. Code and Message are what the server said.
type Error struct {
	Code      codes.Code
	Message   string
	RequestID string
	// RetryAfterMs is the server's retry hint on RESOURCE_EXHAUSTED (0: none).
	RetryAfterMs uint32
	// Resumes counts the resumes sent for the request before this error.
	Resumes int
}

func (e *Error) Error() string {
	if e.RequestID != "" {
		return fmt.Sprintf("draftwise: request %s: %s: %s", e.RequestID, e.Code, e.Message)
	}
	return fmt.Sprintf("draftwise: %s: %s", e.Code, e.Message)
}

func statusError(err error, requestID string) *Error {
	st := status.Convert(err)
	return &Error{Code: st.Code(), Message: st.Message(), RequestID: requestID}
}

func eventError(ev *pb.GenerationEvent) *Error {
	e := ev.GetError()
	return &Error{Code: codes.Code(e.GetCode()), Message: e.GetMessage(), RequestID: ev.GetRequestId(), RetryAfterMs: e.GetRetryAfterMs()}
}

// transportDetails are what gRPC says when the transport broke under a call that it then
// reports as INTERNAL or UNKNOWN rather than UNAVAILABLE.
var transportDetails = []string{"transport is closing", "connection reset", "connection refused", "stream removed", "error reading from server", "EOF"}

func isTransport(e *Error) bool {
	if e.Code == codes.Unavailable {
		return true
	}
	if e.Code == codes.Internal || e.Code == codes.Unknown {
		for _, d := range transportDetails {
			if strings.Contains(strings.ToLower(e.Message), strings.ToLower(d)) {
				return true
			}
		}
	}
	return false
}

// ResumePolicy says how Stream resumes a request whose connection dropped after its first
// delta (the zero value never resumes).
type ResumePolicy struct {
	// MaxAttempts is the number of reconnections in a row without a new event.
	MaxAttempts int
	// InitialBackoff is the delay before the first reconnection; it doubles up to MaxBackoff.
	InitialBackoff time.Duration
	// MaxBackoff bounds the delay.
	MaxBackoff time.Duration
}

// DefaultResume is the Client's default: up to 5 reconnections in a row, 50 ms doubling to 2 s.
var DefaultResume = ResumePolicy{MaxAttempts: 5, InitialBackoff: 50 * time.Millisecond, MaxBackoff: 2 * time.Second}

func (p ResumePolicy) delay(attempt int) time.Duration {
	d := p.InitialBackoff
	for i := 1; i < attempt && d < p.MaxBackoff; i++ {
		d *= 2
	}
	if d > p.MaxBackoff {
		d = p.MaxBackoff
	}
	return d
}

// progress is what the caller has of one request: its resume handle and the index of the
// first token it has not received. It drops replayed deltas and refuses gaps.
type progress struct {
	requestID string
	handle    string
	next      uint32
	finished  bool
}

// accept records ev; keep is false for a delta the caller already has. A gap is DATA_LOSS.
func (p *progress) accept(ev *pb.GenerationEvent) (keep bool, err error) {
	d := ev.GetDelta()
	if d == nil {
		if ev.GetFinished() != nil {
			if p.finished {
				return false, nil
			}
			p.finished = true
		}
		return true, nil
	}
	if d.GetResumeHandle() != "" && p.handle == "" {
		p.handle = d.GetResumeHandle()
	}
	end := d.GetFirstTokenIndex() + uint32(len(d.GetTokenIds()))
	if d.GetFirstTokenIndex() == p.next {
		p.next = end
		return true, nil
	}
	if end <= p.next && len(d.GetTokenIds()) > 0 {
		return false, nil
	}
	return false, &Error{
		Code:      codes.DataLoss,
		Message:   fmt.Sprintf("delta at token %d (+%d) after %d tokens received", d.GetFirstTokenIndex(), len(d.GetTokenIds()), p.next),
		RequestID: p.requestID,
	}
}
