"""The byte-level transformer: shapes, tied embedding, the LM task, and data-parallel
training of its tied weights equal to single-process training (multi-process, gloo)."""
from __future__ import annotations

import math

import pytest
import torch

import lowband
from lowband.app import lr_schedule as schedules, tasks
from lowband.app.data import TEXT_WINDOW, ShardedBatches, TextWindows
from lowband.algorithms.lazy import ForwardOrder, LazyPlan, input_side_layers
from lowband.app.models import GPT, NgramGPT, make_model, ngram_hashes

from .distributed import run_distributed
from .training import max_rel_err, train

STEPS = 6
WINDOW = 16
LOCAL = 4


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(context=WINDOW, d_model=32, n_layers=2, n_heads=4)


def text_data(repeats: int = 40) -> TextWindows:
    g = torch.Generator().manual_seed(7)
    # a learnable stream: a short repeated phrase with random bytes mixed in
    stream = torch.tensor(list(b"def f(x):\n    return x + 1\n" * repeats), dtype=torch.uint8)
    noise = torch.rand(stream.numel(), generator=g) < 0.1
    stream[noise] = torch.randint(0, 256, (int(noise.sum()),), generator=g, dtype=torch.uint8)
    starts = torch.arange(0, stream.numel() - WINDOW - 1, WINDOW)
    return TextWindows(stream, starts, WINDOW, ["fake.py"], "0")


def make_optimizer(kind: str, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # eps 1e-6, not 1e-8: the key bias's gradient is zero in exact arithmetic (softmax ignores a
    # shift shared by all keys), so it is rounding noise that Adam with a tiny eps would blow up
    # to full-size, order-dependent updates; lowband is exact, the noise is not
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)


def test_default_gpt_is_tied_byte_level_and_sized():
    m = make_model("gpt")
    assert m.head.weight is m.tok.weight
    names = [n for n, _ in m.named_parameters()]
    assert "tok.weight" in names and "head.weight" not in names     # one tensor, listed once
    n = sum(p.numel() for p in m.parameters())
    assert 1_000_000 <= n <= 3_000_000
    assert m.context == TEXT_WINDOW
    out = m(torch.randint(0, 256, (2, TEXT_WINDOW)))
    assert out.shape == (2, TEXT_WINDOW, 256)
    # untrained: close to uniform over 256 bytes
    assert abs(tasks.loss(out, torch.randint(0, 256, (2, TEXT_WINDOW))).item() - math.log(256)) < 0.3
    with pytest.raises(ValueError, match="longer than the model's context"):
        m(torch.zeros(1, TEXT_WINDOW + 1, dtype=torch.long))


@pytest.mark.parametrize("make", [lambda: small_gpt(), lambda: small_ngram_gpt()], ids=["gpt", "gpt-ngram"])
def test_gpt_is_causal(make):
    m = make().eval()
    x = torch.randint(0, 256, (1, WINDOW))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 256
    # changing the last byte changes no earlier position's prediction
    assert torch.equal(m(x)[0, :-1], m(y)[0, :-1])


def _ssgd(rank, world, kind):
    model = small_gpt()
    opt = make_optimizer(kind, model)
    engine = lowband.distribute(model, opt, "ssgd", bucket_mb=0.01)
    params = train(model, opt, ShardedBatches(text_data(), LOCAL, rank, world, seed=3), engine.step, STEPS, engine.module)
    engine.synchronize()
    assert model.head.weight is model.tok.weight
    return params, engine.stats.bytes_sent


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_tied_gpt_under_ssgd_equals_single_process(kind):
    results = run_distributed(_ssgd, 2, kind)
    model = small_gpt()
    opt = make_optimizer(kind, model)
    reference = train(model, opt, ShardedBatches(text_data(), 2 * LOCAL, 0, 1, seed=3), opt.step, STEPS, model)
    start = {n: p.detach().clone() for n, p in small_gpt().named_parameters()}
    assert max_rel_err(reference, start) > 1e-3                          # it trained
    for params, sent in results:
        assert max_rel_err(params, reference) <= 1e-5
        assert sent > 0
    assert max_rel_err(results[1][0], results[0][0]) == 0.0


def test_lm_evaluation_reports_bits_per_byte():
    data = text_data()
    m = small_gpt()
    scores = tasks.evaluate(m, data, rank=0, world_size=1, batch_size=7)
    assert scores["bits_per_byte"] == pytest.approx(scores["test_loss"] / math.log(2))
    x, y = data.batch(torch.arange(len(data)))
    with torch.no_grad():
        assert scores["test_loss"] == pytest.approx(tasks.loss(m(x), y).item(), rel=1e-5)
    assert 0.0 <= scores["test_accuracy"] <= 1.0


def test_warmup_cosine_schedule():
    f = [schedules.warmup_cosine(s, 4, 20) for s in range(25)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]                     # linear warm-up to the peak
    assert f[4] == 1.0 and all(a >= b for a, b in zip(f[4:], f[5:]))
    assert f[20] == pytest.approx(schedules.COSINE_FINAL_RATIO) and f[24] == f[20]


def test_pairing_of_model_and_dataset():
    with pytest.raises(ValueError, match="needs a text dataset"):
        tasks.check_pairing("gpt", "fashion-mnist")
    with pytest.raises(ValueError, match="train it with a language model"):
        tasks.check_pairing("cnn", "python-stdlib")
    tasks.check_pairing("gpt", "python-stdlib")
    tasks.check_pairing("cnn", "fashion-mnist")


# -- gpt-ngram: hashed n-gram input embeddings (a heavy input side) ---------------------------

def small_ngram_gpt() -> NgramGPT:
    torch.manual_seed(0)
    return NgramGPT(orders=(2, 3), buckets=64, context=WINDOW, d_model=32, n_layers=2, n_heads=4)


def test_ngram_hashes_match_a_slow_reference():
    idx = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(5))
    for n, buckets in ((2, 4096), (3, 4096), (4, 97), (6, 1 << 20)):
        got = ngram_hashes(idx, n, buckets)
        assert got.dtype == torch.long and got.shape == idx.shape
        for b in range(idx.shape[0]):
            for i in range(idx.shape[1]):
                window = [256] * max(0, n - 1 - i) + idx[b, max(0, i - n + 1):i + 1].tolist()
                h = 0
                for byte in window:                       # oldest first: h = h * 257 + byte (mod p)
                    h = (h * 257 + byte) % (2 ** 31 - 1)
                assert got[b, i] == (h * 2654435761) % 2 ** 32 % buckets


def test_ngram_hash_sees_only_the_last_n_bytes():
    a = torch.tensor([[1, 2, 3, 4, 5, 6]])
    b = torch.tensor([[9, 9, 9, 4, 5, 6]])
    assert torch.equal(ngram_hashes(a, 3, 4096)[0, 5:], ngram_hashes(b, 3, 4096)[0, 5:])
    assert ngram_hashes(a, 3, 4096)[0, 4] != ngram_hashes(b, 3, 4096)[0, 4]


def test_default_gpt_ngram_has_a_heavy_untied_input_side():
    m = make_model("gpt-ngram")
    assert m.head.weight is m.tok.weight and m.orders == (2, 3)
    n = sum(p.numel() for p in m.parameters())
    tables = sum(t.weight.numel() for t in m.ngrams)
    assert tables == 2 * 4096 * 128 and 0.4 < tables / n < 0.5
    assert tasks.task_of("gpt-ngram") == "lm"
    out = m(torch.randint(0, 256, (2, TEXT_WINDOW)))
    assert out.shape == (2, TEXT_WINDOW, 256)
    with pytest.raises(ValueError, match="orders must be >= 2"):
        NgramGPT(orders=(1, 2))


def test_gpt_ngram_tables_are_the_lazy_updates_input_side():
    m = small_ngram_gpt().eval()
    recorder = ForwardOrder(input_side_layers(m))
    m(torch.randint(0, 256, (1, WINDOW)))
    recorder.close()
    assert recorder.order[:4] == ["tok", "pos", "ngrams.0", "ngrams.1"]
    plan = LazyPlan.build(m, list(m.parameters()), recorder.order, 4)
    # tok is tied to the (regular) head, so the lazy set is the position and n-gram tables
    assert plan.layers == ["pos", "ngrams.0", "ngrams.1"]


def _lazy_ngram(rank, world, options, kind="adamw"):
    model = small_ngram_gpt()
    opt = make_optimizer(kind, model)
    engine = lowband.distribute(model, opt, "lazy", bucket_mb=0.01, **options)
    taus = []

    def step():
        engine.step()
        taus.append(engine.bound.step_metrics()["tau"])
    params = train(model, opt, ShardedBatches(text_data(200), LOCAL, rank, world, seed=3), step, 3 * STEPS, engine.module)
    engine.synchronize()
    return params, taus, engine.bound.summary()


def _ssgd_ngram(rank, world):
    model = small_ngram_gpt()
    opt = make_optimizer("adamw", model)
    engine = lowband.distribute(model, opt, "ssgd", bucket_mb=0.01)
    params = train(model, opt, ShardedBatches(text_data(200), LOCAL, rank, world, seed=3), engine.step, 3 * STEPS, engine.module)
    engine.synchronize()
    return params


def test_lazy_on_gpt_ngram_defaults_to_its_tables_with_a_scaled_window_step_under_adamw():
    ssgd = run_distributed(_ssgd_ngram, 2)
    capped = run_distributed(_lazy_ngram, 2, {"tau_max": 1})
    auto = run_distributed(_lazy_ngram, 2, {})
    for r in range(2):
        assert max_rel_err(capped[r][0], ssgd[r]) == 0.0                # a window of 1 is ssgd
        assert capped[r][1] == [1] * (3 * STEPS)
    params, taus, summary = auto[0]
    # the default lazy set: the leading embedding tables (tok is tied to the head: regular)
    assert summary["lazy_layers"] == ["pos", "ngrams.0", "ngrams.1"]
    assert summary["window_scaled_parameters"] == ["pos.weight", "ngrams.0.weight", "ngrams.1.weight"]
    assert max(taus) >= 3 and summary["lazy_syncs"] < 3 * STEPS      # syncs really skipped
    assert max_rel_err(auto[1][0], params) == 0.0                      # the replicas agree
    # "auto" scales exactly the tables here (AdamW), so it is "scaled"; "sum" is another run
    scaled = run_distributed(_lazy_ngram, 2, {"window_step": "scaled"})[0]
    summed = run_distributed(_lazy_ngram, 2, {"window_step": "sum"})[0]
    assert max_rel_err(scaled[0], params) == 0.0 and scaled[1] == taus
    assert max_rel_err(summed[0], params) > 0.0 and summed[2]["window_scaled_parameters"] == []
    # under SGD (the step grows with the gradient) "auto" scales nothing
    sgd = run_distributed(_lazy_ngram, 2, {}, "sgd")[0]
    assert sgd[2]["lazy_layers"] == ["pos", "ngrams.0", "ngrams.1"] and sgd[2]["window_scaled_parameters"] == []

