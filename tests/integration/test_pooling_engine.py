"""``--runner pooling`` in the engine, on a tiny Llama: the vectors equal transformers'
``AutoModel`` hidden states pooled the same way (LAST, MEAN, CLS; normalised or not), across
chunked prefill and prefix-cache hits; and what a pooling engine refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from corefleet.engine import LLM
from corefleet.engine.engine_core.core import EngineCore
from corefleet.engine.messages import EngineCoreOutput, EngineCoreRequest, PoolingParams
from corefleet.engine.messages import SamplingParams as Sampling
from tests.fixtures_models import write_tiny_llama

# Longer than the token budget below: every such prompt is computed over several steps.
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 320, size=45)]
SHORT = [5, 17, 99, 4, 250, 31, 8]
BUDGET = 16  # --max-num-batched-tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")
    config = json.loads((path / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]  # read only by a pooling runner
    (path / "config.json").write_text(json.dumps(config))
    return path


def _llm(folder: Path, **kwargs: object) -> LLM:
    return LLM(
        str(folder),
        multiprocess=False,
        dtype="float32",
        kv_cache_memory=8 << 20,
        block_size=4,
        max_num_batched_tokens=BUDGET,
        **kwargs,
    )


@pytest.fixture(scope="module")
def core(folder: Path) -> EngineCore:
    engine: EngineCore = _llm(folder, runner="pooling").engine_client.engine
    return engine


@pytest.fixture(scope="module")
def hidden_states(folder: Path):  # type: ignore[no-untyped-def]
    """transformers' final-norm hidden states of a prompt: ``[L, H]`` float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return run


def _expected(hidden: torch.Tensor, kind: str, normalise: bool, dims: int | None) -> np.ndarray:
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[kind]
    if dims is not None:
        vector = vector[:dims]
    if normalise:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


def _pool(core: EngineCore, requests: dict[str, tuple[list[int], PoolingParams]]) -> dict:  # type: ignore[type-arg]
    """Run pooling requests to their finish; each one's final output."""
    for req_id, (ids, params) in requests.items():
        core.add_request(
            EngineCoreRequest(req_id, ids, Sampling(max_tokens=1), pooling_params=params)
        )
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(500):  # bounded: a few steps per request suffice
        outputs, _ = core.step()
        for batch in outputs.values():
            for output in batch.outputs:
                assert output.new_token_ids == [], "a pooling request samples nothing"
                if output.finished:
                    finished[output.request_id] = output
        if len(finished) == len(requests):
            break
    assert set(finished) == set(requests)
    assert not core.has_unfinished_requests()
    return finished


def _vector(output: EngineCoreOutput) -> np.ndarray:
    assert output.pooling_output is not None
    assert str(output.finish_reason) == "stop"
    return np.frombuffer(output.pooling_output, dtype="<f4")


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalise", [True, False])
def test_vectors_equal_transformers(core, hidden_states, kind: str, normalise: bool) -> None:  # type: ignore[no-untyped-def]
    params = PoolingParams(pooling_type=kind, use_activation=normalise)  # type: ignore[arg-type]
    # A batch: a prompt chunked over several steps beside a short one.
    outs = _pool(
        core,
        {
            f"{kind}-{normalise}-long": (PROMPT, params),
            f"{kind}-{normalise}-short": (SHORT, params),
        },
    )
    for ids, name in ((PROMPT, "long"), (SHORT, "short")):
        got = _vector(outs[f"{kind}-{normalise}-{name}"])
        want = _expected(hidden_states(ids), kind, normalise, None)
        assert got.shape == (64,)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        if normalise:
            assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5


def test_prefix_cache_hits_give_the_same_vectors(core, hidden_states) -> None:  # type: ignore[no-untyped-def]
    """The second run of a prompt finds its blocks cached: LAST reads them, MEAN and CLS do
    not (cached positions have no hidden states), and all three still give the same vector."""
    hits_before = core.scheduler.kv_cache_manager.prefix_cache_hits
    for round_ in range(2):
        outs = _pool(
            core,
            {
                f"{k}-{round_}": (PROMPT, PoolingParams(pooling_type=k))
                for k in ("LAST", "MEAN", "CLS")
            },  # type: ignore[arg-type]
        )
        for kind in ("LAST", "MEAN", "CLS"):
            want = _expected(hidden_states(PROMPT), kind, True, None)
            np.testing.assert_allclose(_vector(outs[f"{kind}-{round_}"]), want, atol=1e-4)
    assert core.scheduler.kv_cache_manager.prefix_cache_hits > hits_before
    assert outs["LAST-1"].num_cached_tokens > 0
    assert outs["MEAN-1"].num_cached_tokens == 0 and outs["CLS-1"].num_cached_tokens == 0


def test_matryoshka_dimensions_truncate_then_normalise(core, hidden_states) -> None:  # type: ignore[no-untyped-def]
    outs = _pool(core, {"dims": (SHORT, PoolingParams(dimensions=32))})
    got = _vector(outs["dims"])
    np.testing.assert_allclose(got, _expected(hidden_states(SHORT), "LAST", True, 32), atol=1e-4)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (PoolingParams(dimensions=20), "supports only dimensions"),
        (PoolingParams(dimensions=0), "supports only dimensions"),
        (None, "generation is refused"),
    ],
)
def test_a_pooling_engine_refuses(core, params, message: str) -> None:  # type: ignore[no-untyped-def]
    request = EngineCoreRequest("bad", SHORT, Sampling(max_tokens=3), pooling_params=params)
    with pytest.raises(ValueError, match=message):
        core.add_request(request)
    assert not core.has_unfinished_requests()
    assert _vector(_pool(core, {"after": (SHORT, PoolingParams())})["after"]).shape == (64,)


def test_a_generating_engine_refuses_pooling_and_others_refuse_dimensions(tmp_path: Path) -> None:
    plain = write_tiny_llama(tmp_path / "plain")  # no Matryoshka sizes in its config
    generating = _llm(plain).engine_client.engine
    with pytest.raises(ValueError, match="pooling is refused"):
        generating.add_request(
            EngineCoreRequest("p", SHORT, Sampling(), pooling_params=PoolingParams())
        )
    assert generating.make_ready_response(0).pooler is None
    pooling = _llm(plain, runner="pooling").engine_client.engine
    info = pooling.make_ready_response(0).pooler
    assert info is not None and info.pooling_type == "LAST" and not info.is_matryoshka
    with pytest.raises(ValueError, match="matryoshka"):
        pooling.add_request(
            EngineCoreRequest("d", SHORT, Sampling(), pooling_params=PoolingParams(dimensions=8))
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "JSON object"),
        ('{"pooling_type": "ALL"}', "pooling_type"),
        ('{"use_activation": "yes"}', "use_activation"),
        ('{"dimensions": 0}', "dimensions"),
        ('{"softmax": true}', "unsupported keys"),
        ("{", "not JSON"),
    ],
)
def test_bad_pooler_config_names_the_key(text: str, message: str) -> None:
    from corefleet.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(runner="pooling", pooler_config=text)
    with pytest.raises(ValueError, match="runner"):
        EngineConfig.from_kwargs(runner="draft")


def test_preempted_requests_pool_from_scratch(core, hidden_states) -> None:  # type: ignore[no-untyped-def]
    """Requests preempted mid-prompt (every running one, as a prefix-cache reset with
    reset_running_requests does) are computed again: MEAN's running sum and CLS's first state
    restart with them."""
    kinds = ("MEAN", "CLS", "LAST")
    for kind in kinds:
        params = PoolingParams(pooling_type=kind)  # type: ignore[arg-type]
        core.add_request(
            EngineCoreRequest(kind, PROMPT, Sampling(max_tokens=1), pooling_params=params)
        )
    core.step()
    core.step()  # MEAN has 32 of its 45 tokens, the others wait
    running = [r.request_id for r in core.scheduler.running]
    assert running and all(core.scheduler.requests[r].num_computed_tokens < 45 for r in running)
    preemptions = core.scheduler.num_preemptions
    assert core.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert core.scheduler.num_preemptions > preemptions
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(100):
        outputs, _ = core.step()
        for batch in outputs.values():
            finished |= {o.request_id: o for o in batch.outputs if o.finished}
        if len(finished) == len(kinds):
            break
    for kind in kinds:
        want = _expected(hidden_states(PROMPT), kind, True, None)
        np.testing.assert_allclose(_vector(finished[kind]), want, atol=1e-4)
