"""FLOP efficiency of the scorer's graphs against this machine's fp32 matmul peak -> scorer_flops.json

    python -m benchmarks.scorer_flops --threads 1

Peak: a 2048x2048x2048 fp32 matrix product in ONNX Runtime (the library the scorer runs on, same threads), timed in
turns with the graphs so that both see the same machine load. Achieved: FLOPs per token (the matrix products of the graph, counted in
benchmarks/scoring_graphs.py) x tokens/s of the 2x256 LSTM sentence graphs on held-out Gutenberg sentences (45k
vocabulary): the LSTM alone, the self-normalised target-only graph and the full-softmax graph.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from benchmarks.common import ROOT, time_interleaved, write_result
from benchmarks.scoring_graphs import GraphSet, gutenberg_sentences

N = 2048


class OnnxMatmul:
    """A 2048^3 fp32 matrix product in ONNX Runtime (the library the scorer runs on), with the scorer's threads."""

    flops = 2 * N**3

    def __init__(self, threads: int):
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["a", "b"], ["c"])],
            "matmul",
            [helper.make_tensor_value_info(x, TensorProto.FLOAT, [N, N]) for x in ("a", "b")],
            [helper.make_tensor_value_info("c", TensorProto.FLOAT, [N, N])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.a = np.random.default_rng(0).standard_normal((N, N), dtype=np.float32)

    def __call__(self) -> None:
        self.session.run(None, {"a": self.a, "b": self.a})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=400)
    args = parser.parse_args()
    matmul = OnnxMatmul(args.threads)
    sentences = gutenberg_sentences(45000, args.sentences)
    graphs = GraphSet.build(45000, ROOT / "var" / "bench" / "graphs_45k", threads=args.threads)
    tokens = sum(len(s) + 1 for s in sentences)
    cases = {"matmul": matmul, **{kind: (lambda k=kind: graphs.run(k, sentences)) for kind in graphs.kinds}}
    seconds = time_interleaved(cases, args.rounds)
    peak = matmul.flops / seconds["matmul"] / 1e9
    flops = graphs.flops_per_token()
    achieved = {kind: flops[kind] * tokens / seconds[kind] / 1e9 for kind in graphs.kinds}
    write_result(
        "scorer_flops",
        {
            "percent_of_peak": 100 * achieved["lstm"] / peak,
            "peak_gflops_onnxruntime": peak,
            "lstm_gflops": achieved["lstm"],
            "target_graph_gflops": achieved["target"],
            "full_graph_gflops": achieved["full"],
            "full_graph_percent_of_peak": 100 * achieved["full"] / peak,
            "lstm_tokens_per_s": tokens / seconds["lstm"],
        },
        flops_per_token=flops,
        threads=args.threads,
        onnx_version=onnx.__version__,
        onnxruntime_version=ort.__version__,
    )


if __name__ == "__main__":
    main()
