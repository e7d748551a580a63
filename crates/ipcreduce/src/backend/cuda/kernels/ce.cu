// ipcreduce copy-engine all-reduce kernels (two ranks; see ../ce.rs): registered buffers out of
// place, the copies cuMemcpyAsync pushes into the peer's output; or the host-staged transport,
// the copies into and out of host memory. These kernels order the copies across the processes
// and reduce locally. Built on prims.cuh.
//
// Layout: the lanes' barriers use the counters and flag slots of the last blocks (the host's
// FIRST_LANE_SLOT); no workspace data.
//
// Ordering. Each lane is used by one stream of the call, in the same order on both ranks; before
// and after the call the lanes' slots are used only by kernels ordered with it on the caller's
// stream, so invariant (3) holds. Every lane's first barrier compares the stamps (CHECK_STAMPS);
// lane 0's first barrier is the call's start (CHECK_BEGIN): it advances the call counter and
// posts the identity (invariant 1), before any push of the call is enqueued behind it on lane 0,
// and lane 1's pushes follow its own first barrier, which meets the peer's only once the peer's
// lane 1 has passed its identity check too. The later barriers and the reduce kernels do not
// know the call number (call 0: their waits skip the board).
//
// Phase stamps (traced): the kernels of a call stamp one row each of the ring (a.trace_row,
// chosen by the host, ../ce.rs `Rows`; a lane's first barrier's is its lane slot, where
// barrier_at stamps the peer): a barrier its start (the copies before it on its lane are done),
// when it saw the peer and its end; a barrier followed by a reduce of the same chunk
// (CHECK_ROW_REDUCED) leaves its row's reduce and end to that kernel, whose blocks each raise
// them to their own end.

#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_CE)
// One block: a barrier on lane `a.lane`'s counter and flags.
extern "C" __global__ void __launch_bounds__(32) ipcr_ce_barrier(const Args a) {
    wait_for_previous_kernel();
    TRACE_ROW(a, PH_START);
    u32 *ctr = a.counters + 2 * a.lane;
    const bool begins = (a.check & CHECK_BEGIN) != 0;
    const bool first = (a.check & CHECK_STAMPS) != 0;
    // Later barriers do not start a call, but guard the pushes behind them the same way.
    const u64 call = begins ? begin_call(a) : (open_call_counter(a), 0);
    u32 F = ctr[0];
    const bool met = barrier_at(a, F, call, first, a.lane);
    // (A first barrier stamps the peer inside, from the thread that waited for it.)
    if (met && !first) TRACE_ROW(a, PH_PEER + (1 - a.rank));
    if (threadIdx.x == 0) ctr[0] = F;
    if (begins) finish_call(a, call);
    if ((a.check & CHECK_ROW_REDUCED) != 0) {
        TRACE_ROW_CLEAR(a, PH_REDUCE);
        TRACE_ROW_CLEAR(a, PH_END);
    } else {
        TRACE_ROW(a, PH_END);
    }
}
#endif

// Our send holds our input, rsend[peer] the peer's input as copied here (our recv, where the
// peer pushed it, or the host-staged path's device scratch): reduced in rank order into recv
// (each element read, then written, by one thread, so recv may be either source).
struct CeSrc {
    const Args &a;
    __device__ const char *operator()(int r) const { return r == a.rank ? a.send : a.rsend[r]; }
};

template <typename D, typename Op> __device__ void ce_reduce(const Args &a) {
    u64 b, e;
    piece<D>(0, a.count, gridDim.x, blockIdx.x, b, e);
    const char *theirs = a.rsend[1 - a.rank];
    reduce_range<D, Op, 2>(CeSrc{a}, OwnDst{a.recv, aligned16(a.recv)}, 2, b, e,
                           aligned16(a.send) && aligned16(a.recv) && aligned16(theirs));
    // The chunk's row (its barrier's): reduced and ended with the last block.
    TRACE_ROW_LATEST(a, PH_REDUCE);
    TRACE_ROW_LATEST(a, PH_END);
}

// Entry points: ipcr_cereduce_<dtype>_<op> (two ranks only: one kernel in every module).
#define CE_KERNELS(DT, OPN, D, OP) ENTRY(2, ipcr_cereduce_##DT##_##OPN, (ce_reduce<D, OP>(a)))
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_CE)
FOR_EACH_DTYPE_OP(CE_KERNELS)
#endif
