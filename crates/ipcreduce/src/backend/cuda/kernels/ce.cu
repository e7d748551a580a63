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

#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_CE)
// One block: a barrier on lane `a.lane`'s counter and flags.
extern "C" __global__ void __launch_bounds__(32) ipcr_ce_barrier(const Args a) {
    wait_for_previous_kernel();
    u32 *ctr = a.counters + 2 * a.lane;
    const bool begins = (a.check & CHECK_BEGIN) != 0;
    // Later barriers do not start a call, but guard the pushes behind them the same way.
    const u64 call = begins ? begin_call(a) : (open_call_counter(a), 0);
    u32 F = ctr[0];
    barrier_at(a, F, call, (a.check & CHECK_STAMPS) != 0, a.lane);
    if (threadIdx.x == 0) ctr[0] = F;
    if (begins) finish_call(a, call);
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
}

// Entry points: ipcr_cereduce_<dtype>_<op> (two ranks only: one kernel in every module).
#define CE_KERNELS(DT, OPN, D, OP) ENTRY(2, ipcr_cereduce_##DT##_##OPN, (ce_reduce<D, OP>(a)))
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_CE)
FOR_EACH_DTYPE_OP(CE_KERNELS)
#endif
