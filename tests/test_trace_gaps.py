"""bench/trace_gaps.py on a hand-made trace: busy time, and each gap told apart as the host's (the next kernel
launched after the gap began, named by its launching operators) or the GPU's own (launched before)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from trace_gaps import analyse  # noqa: E402


def test_gaps_split_into_host_late_and_gpu_waiting():
    op = lambda name, ts, dur: {"ph": "X", "cat": "cpu_op", "name": name, "pid": 0, "tid": 1, "ts": ts, "dur": dur}  # noqa: E731
    launch = lambda ts, c: {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0, "tid": 1, "ts": ts, "dur": 2,  # noqa: E731
                            "args": {"correlation": c}}
    kernel = lambda name, ts, dur, c, tid=7: {"ph": "X", "cat": "kernel", "name": name, "pid": 5, "tid": tid, "ts": ts, "dur": dur,  # noqa: E731
                                             "args": {"correlation": c}}
    events = [op("layer", 0, 1000), op("aten::mm", 100, 10), launch(105, 1), op("aten::add", 300, 10), launch(305, 2), launch(306, 3),
              kernel("k1", 110, 100, 1),  # busy 110-210
              kernel("k2", 310, 50, 2),  # 100 us idle before it; launched at 305, after the gap began (210): the host's
              kernel("k3", 380, 20, 3),  # 20 us idle; launched at 306, before the gap began (360): the GPU's own
              kernel("other_stream", 0, 5, 4, tid=8)]  # a stream with less kernel time: not the one read
    result = analyse(events, min_us=5)
    assert result["stream"] == [5, 7] and result["kernels"] == 3
    assert abs(result["busy_ms"] - 0.170) < 1e-9 and abs(result["idle_ms"] - 0.120) < 1e-9
    assert abs(result["host_late_ms"] - 0.100) < 1e-9 and abs(result["device_wait_ms"] - 0.020) < 1e-9
    assert result["host_late_by_launcher"] == [("aten::add < layer", 1, 0.1)]
    assert result["device_wait_before_kernel"] == [("k3", 1, 0.02)]
    assert result["gap_sizes"]["50-500 us"] == {"count": 1, "ms": 0.1} and result["gap_sizes"]["5-50 us"] == {"count": 1, "ms": 0.02}
    assert result["kernel_time"] == [("k1", 1, 0.1), ("k2", 1, 0.05), ("k3", 1, 0.02)]  # the busiest stream's, longest first


def test_collectives_kernel_time_and_the_part_no_other_kernel_hides():
    kernel = lambda name, ts, dur, tid: {"ph": "X", "cat": "kernel", "name": name, "pid": 5, "tid": tid, "ts": ts, "dur": dur,  # noqa: E731
                                        "args": {"correlation": ts}}
    events = [kernel("gemm", 0, 100, 7), kernel("ncclDevKernel_SendRecv(args)", 50, 100, 9),  # 50 us beside the gemm
              kernel("ncclDevKernel_AllGather_RING_LL(args)", 300, 40, 9), kernel("add", 320, 10, 7),  # 10 us hidden
              kernel("ncclDevKernel_SendRecv(args)", 400, 20, 9)]
    result = analyse(events, min_us=5)
    assert result["collectives"] == [("SendRecv", 2, 0.12, 0.07), ("AllGather_RING_LL", 1, 0.04, 0.03)]


def test_a_kernels_durations_and_what_ran_beside_it_on_other_streams():
    kernel = lambda name, ts, dur, tid: {"ph": "X", "cat": "kernel", "name": name, "pid": 5, "tid": tid, "ts": ts, "dur": dur,  # noqa: E731
                                        "args": {"correlation": ts}}
    events = [kernel("_weight_grad_kernel", 0, 100, 7), kernel("ncclDevKernel_AllReduce(args)", 60, 100, 9),  # 40 us beside
              kernel("gemm", 100, 50, 7),  # the same stream: not beside
              kernel("_weight_grad_kernel", 200, 300, 7), kernel("barrier_kernel(x)", 250, 10, 8),
              kernel("ncclDevKernel_AllReduce(args)", 480, 100, 9)]  # 20 us beside the second
    found = analyse(events, beside_kernel="_weight_grad")["beside"]
    assert found["count"] == 2 and found["ms"] == 0.4 and found["us_in_order"] == [100, 300]
    assert found["us_min_median_max"] == [100, 300, 300]
    assert found["beside_ms"] == [("ncclDevKernel_AllReduce", 0.06), ("barrier_kernel", 0.01)]
