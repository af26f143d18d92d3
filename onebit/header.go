package onebit

// The header of the 1-bit compressed allreduce (allreduce.go): the first
// collective of every call, an all-gather of each rank's tensor length and
// its tuning fields (tune.go), which agrees on every length of the call
// before any tensor data moves, and by which a rank that refuses a call
// tells the others.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
)

// headerLen is the bytes each rank contributes to the header all-gather:
// a little-endian uint64 whose low 40 bits are the tensor length it called
// with, so that mismatched sizes are caught on every rank even when they
// pad to the same N, and whose high 24 bits are the fields of the choice
// between whole chunks and pieces (tune.go): this call's pieces per chunk,
// whether the rank starts its collectives and how long its previous call
// took. The worker scales travel in phase 1 (see scaled).
const headerLen = 8

// refusedLen is the tensor length a rank puts in its header when it
// refuses the call (bad arguments, or a failure of its own before the
// header): no real tensor has it.
const refusedLen = math.MaxUint64

// refuse takes part in the header all-gather of a call this rank refuses,
// so that the other ranks return an error instead of waiting for it, and
// returns bad (with the all-gather's error, if it failed too). It
// allocates its header: refusing is not the hot path, and a refusing rank
// may have no State to take one from.
func refuse(ctx context.Context, c comm.Comm, bad error) error {
	w := c.Size()
	hdr, all := make([]byte, headerLen), make([]byte, headerLen*w)
	binary.LittleEndian.PutUint64(hdr, refusedLen)
	if err := c.AllGatherBytes(ctx, hdr, all); err != nil {
		return errors.Join(bad, fmt.Errorf("onebit: telling the other ranks: %w", err))
	}
	return bad
}

// exchangeHeader all-gathers this rank's header, the tensor length it was
// called with and its tuning fields, and checks it (readHeader).
func (st *State) exchangeHeader(ctx context.Context, c comm.Comm) error {
	st.putHeader()
	t := st.start()
	if err := c.AllGatherBytes(ctx, st.header, st.headers); err != nil {
		return err
	}
	st.span(PhaseHeader, 0, t)
	return st.readHeader()
}

// startHeader begins a whole-chunk call's header: started through s where
// this call may start its collectives (the caller moves it with Test
// between blocks of its first pass: see comm/mpi's StartAllGatherBytes),
// else exchanged at once, blocking, its Request done. endHeader finishes
// it.
func (st *State) startHeader(ctx context.Context, c comm.Comm, s comm.Starter) (comm.Request, error) {
	if s == nil || !st.starts {
		return comm.Done{}, st.exchangeHeader(ctx, c)
	}
	st.putHeader()
	return s.StartAllGatherBytes(ctx, st.header, st.headers)
}

// endHeader waits for a header startHeader started at t (finish) and
// checks it; one exchanged at once has been checked already.
func (st *State) endHeader(req comm.Request, t time.Time) error {
	if _, blocking := req.(comm.Done); blocking {
		return nil
	}
	if err := st.finish(req, PhaseHeader, t); err != nil {
		return err
	}
	return st.readHeader()
}

// putHeader writes this rank's header: the tensor length and the tuning
// fields.
func (st *State) putHeader() {
	binary.LittleEndian.PutUint64(st.header, uint64(st.numel)|st.tuning())
}

// readHeader checks the gathered headers (no rank refused the call, every
// rank has the same length) and takes the tuning fields.
func (st *State) readHeader() error {
	for j := range st.world {
		if binary.LittleEndian.Uint64(st.headers[j*headerLen:]) == refusedLen {
			return fmt.Errorf("onebit: rank %d refused the call (bad arguments or a failure of its own; its error says which)", j)
		}
	}
	want := binary.LittleEndian.Uint64(st.headers) & lenMask
	for j := 1; j < st.world; j++ {
		if got := binary.LittleEndian.Uint64(st.headers[j*headerLen:]) & lenMask; got != want {
			return &comm.MismatchError{Collective: comm.CAllGather, What: "onebit tensor length",
				Rank: j, Got: int(got), Want: int(want)}
		}
	}
	return st.takeTuning()
}
