// ipcreduce zero-copy all-reduce kernels (registered buffers, read and written where they
// are): one-shot and two-shot, each with 8 or 16 (deep) packs in flight. Built on prims.cuh.
//
// Layout: no workspace data, no chunks; only the signal area (flags, stamps, board).
//
// Ordering.
// Zero-copy kernels (registered buffers) touch no workspace data: "inputs ready" barrier, read
//     every rank's send, write, "done" barrier. The done barrier makes the peers' stores into our
//     recv visible before we return and guarantees no peer still reads our send, so the next
//     call (or the caller) may overwrite either. Two-shot touches element i of every buffer only
//     from the thread of the shard's owner that reads it and then writes it, so send == recv is
//     safe; one-shot in place is not (a peer may read our element after we wrote the sum), and
//     the host never sends an in-place call there.
//
template <typename D, typename Op, int W, int LOADS> __device__ void one_shot_reg(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0];
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    if (barrier(a, F, call, true)) { // inputs ready
        u64 b, e;
        piece<D>(0, a.count, gridDim.x, blockIdx.x, b, e);
        reduce_range<D, Op, W, LOADS>(SendSrc{a}, OwnDst{a.recv, aligned16(a.recv)}, a.world, b, e,
                                      (a.aligned & 1) != 0);
        TRACE_BLOCK(a, PH_REDUCE);
        barrier(a, F, call); // done reading every send
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call);
    TRACE_PHASE(a, PH_END);
}

template <typename D, typename Op, int W, int LOADS> __device__ void two_shot_reg(const Args &a) {
    u32 *ctr = a.counters + 2 * blockIdx.x;
    u32 F = ctr[0];
    const u64 call = begin_call(a);
    TRACE_PHASE(a, PH_START); // (after the closed-counter check: see CALL_CLOSED)
    if (barrier(a, F, call, true)) { // inputs ready
        u64 b, e;
        shard_piece<D>(a.count, a.count, a.world, a.rank, b, e);
        // Reduce-scatter by loads from every rank, all-gather by stores into every rank's recv.
        reduce_range<D, Op, W, LOADS>(SendSrc{a}, AllRecvDst{a}, a.world, b, e, (a.aligned & 1) != 0);
        TRACE_BLOCK(a, PH_REDUCE); // reduced and stored everywhere (the gather is the stores)
        barrier(a, F, call); // every shard stored everywhere, every send read
    }
    if (threadIdx.x == 0) ctr[0] = F;
    finish_call(a, call);
    TRACE_PHASE(a, PH_END);
}

// Entry points: ipcr_{oneshotreg,twoshotreg,oneshotreg16,twoshotreg16}_w<W>_<dtype>_<op> (the
// plain and the deep ones compiled apart: a job uses one depth, IPCREDUCE_REG_LOADS).
#define ZC_KERNELS_W(DT, OPN, D, OP, W)                                                       \
    ENTRY(2, ipcr_oneshotreg_w##W##_##DT##_##OPN, (one_shot_reg<D, OP, W, LOADS_IN_FLIGHT>(a))) \
    ENTRY(2, ipcr_twoshotreg_w##W##_##DT##_##OPN, (two_shot_reg<D, OP, W, LOADS_IN_FLIGHT>(a)))
#define ZC16_KERNELS_W(DT, OPN, D, OP, W)                                                     \
    ENTRY(1, ipcr_oneshotreg16_w##W##_##DT##_##OPN,                                           \
          (one_shot_reg<D, OP, W, DEEP_LOADS_IN_FLIGHT(W)>(a)))                               \
    ENTRY(1, ipcr_twoshotreg16_w##W##_##DT##_##OPN,                                           \
          (two_shot_reg<D, OP, W, DEEP_LOADS_IN_FLIGHT(W)>(a)))
#define ZC_KERNELS_FOR(DT, OPN, D, OP, W) ZC_KERNELS_W(DT, OPN, D, OP, W)
#define ZC_KERNELS(DT, OPN, D, OP) ZC_KERNELS_FOR(DT, OPN, D, OP, IPCR_W)
#define ZC16_KERNELS_FOR(DT, OPN, D, OP, W) ZC16_KERNELS_W(DT, OPN, D, OP, W)
#define ZC16_KERNELS(DT, OPN, D, OP) ZC16_KERNELS_FOR(DT, OPN, D, OP, IPCR_W)
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_ZEROCOPY)
FOR_EACH_DTYPE_OP(ZC_KERNELS)
#endif
#if !defined(IPCR_ONE_GROUP) || defined(IPCR_GROUP_ZEROCOPY16)
FOR_EACH_DTYPE_OP(ZC16_KERNELS)
#endif
