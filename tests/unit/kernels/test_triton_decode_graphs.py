"""The Triton kernel set inside the decode-graph path: what a captured graph replays on a GPU, run here through
Triton's interpreter on the CPU (the capture is the eager stand-in; real graphs are tests/gpu's).

It checks what the unit tests of each kernel cannot: the kernels read the graphs' static buffers as they are laid
out (slots as a row of the shared token buffer, block tables wider than any step needs, padding rows in the
scratch block), and the whole model on them samples what the torch reference ops sample.
"""

from __future__ import annotations

import pytest
import torch

from engine_server.cuda_graphs import EagerCapture
from ladle_kernels.triton_ops import TRITON_OPS
from tests.unit.runner_factories import greedy_request, make_lockstep, tiny_engine_config, tiny_runner


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path; tests/gpu replays real graphs")
def test_triton_kernels_on_padded_graph_buffers_sample_what_the_reference_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = tiny_engine_config(max_cuda_graph_batch=8)
    reference, candidate = tiny_runner(config), tiny_runner(config)
    candidate.model.ops = TRITON_OPS
    graphs = candidate.capture_decode_graphs(EagerCapture())
    lengths, max_tokens = [3, 17, 5, 40, 9, 1], [4, 4, 6, 6, 3, 5]
    requests = [greedy_request(f"t{i}", n, m) for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))]

    steps = make_lockstep(reference, candidate, config, monkeypatch).run(requests)

    assert sum(graphs.replays.values()) == sum(s.decode_only for s in steps) >= 4
    assert graphs.replays[8] and graphs.replays[4]  # 6 rows padded to 8, then 4 and 2 rows padded to 4 or 2
    for step in steps:
        assert step.tokens[1] == step.tokens[0]
        torch.testing.assert_close(step.hidden[1], step.hidden[0], atol=1e-4, rtol=1e-4)
