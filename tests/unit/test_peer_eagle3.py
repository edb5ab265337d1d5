"""`python -m sglang_dart.train --format eagle3` writes a checkpoint that SGLang's `LlamaForCausalLMEagle3`
loads (its config parsing, its `load_weights`, its d2t reading) and that computes, through SGLang's own
forward code, the logits of an independent plain-torch EAGLE3 drafter written here, both on the target's
taps (draft extend) and on its own fed-back hidden states (draft decode steps); the trainer's unrolled
training-time-test forward computes the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_dart.train.__main__ import main as train_main
from sglang_dart.train.features import tap_layers
from tests.support.dart_assets import build_random_drafter
from tests.support.tiny_models import build_tiny_model, training_corpus

DRAFT_VOCAB = 300


def _write_data(path: Path, rows: int = 12) -> Path:
    texts = [t[:500] for t in training_corpus(rows)]
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return path


def _train(target: Path, out: Path, data: Path, *extra: str) -> None:
    train_main(
        [
            "--format",
            "eagle3",
            "--target",
            str(target),
            "--data",
            str(data),
            "--out",
            str(out),
            "--draft-vocab-size",
            str(DRAFT_VOCAB),
            "--max-steps",
            "6",
            "--max-len",
            "96",
            "--eagle3-ttt-steps",
            "3",
            "--eagle3-window",
            "48",
            "--holdout",
            "0.2",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def eagle3_ckpt(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eagle3-ckpt")
    out = root / "draft"
    _train(tiny_llama_dir, out, _write_data(root / "data.jsonl"))
    return out


def test_training_reports_progress_and_a_held_out_estimate(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    _train(tiny_llama_dir, tmp_path / "d", _write_data(tmp_path / "data.jsonl"), "--max-steps", "4")
    out = capsys.readouterr().out
    assert "step 4/4 loss" in out and "top-1 by step [" in out and "ETA" in out
    assert "estimated tau" in out
    report = json.loads((tmp_path / "d" / "train_report.json").read_text())
    assert report["format"] == "eagle3" and report["steps"] == 4 and report["held_out"]["tau_chain"] >= 1.0
    assert report["args"]["row_decay"] == "0.8"  # EAGLE3 keeps its own default γ


def test_checkpoint_layout(eagle3_ckpt: Path, tiny_llama_dir: Path):
    config = json.loads((eagle3_ckpt / "config.json").read_text())
    target = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["tie_word_embeddings"] is False
    # SGLang captures the input of layer id + 1 for each id it is given.
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert [i + 1 for i in ids] == tap_layers(target["num_hidden_layers"])
    tensors = load_file(str(eagle3_ckpt / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors  # the worker hands the drafter the target's embedding
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, target["hidden_size"])
    assert tensors["fc.weight"].shape == (target["hidden_size"], 3 * target["hidden_size"])
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    target_ids = torch.arange(DRAFT_VOCAB) + d2t
    assert bool((target_ids[1:] > target_ids[:-1]).all())
    assert t2d.nonzero().squeeze(1).tolist() == target_ids.tolist()


# ---- an independent EAGLE3 drafter in plain torch, from the checkpoint's tensors ----


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE on [T, heads, D] as complex rotations of (x_i, x_{i + D/2}) pairs."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    turn = torch.polar(torch.ones(pos.shape[0], half, dtype=torch.float64), pos.double()[:, None] * freq)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * turn[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


class Reference:
    """One forward of the EAGLE3 layer per call, keeping its own K/V cache (positions in order)."""

    def __init__(self, ckpt: Path, embed: torch.Tensor) -> None:
        self.cfg = json.loads((ckpt / "config.json").read_text())
        self.w = load_file(str(ckpt / "model.safetensors"))
        self.embed = embed
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor):  # noqa: ANN201
        """(logits over the draft vocabulary, pre-norm hidden state fed to the next step)."""
        cfg, w = self.cfg, self.w
        eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        if hidden.shape[-1] != cfg["hidden_size"]:
            hidden = hidden @ w["fc.weight"].T
        x = torch.cat(
            [
                _rms(self.embed[tokens], w["midlayer.input_layernorm.weight"], eps),
                _rms(hidden, w["midlayer.hidden_norm.weight"], eps),
            ],
            dim=-1,
        )
        t = x.shape[0]
        q = _rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, nh, d), pos, theta)
        k = _rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, d), pos, theta)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, d)
        self.keys.append(k)
        self.values.append(v)
        keys = torch.cat(self.keys).repeat_interleave(nh // nkv, dim=1)
        values = torch.cat(self.values).repeat_interleave(nh // nkv, dim=1)
        past = keys.shape[0] - t
        scores = torch.einsum("qhd,khd->hqk", q, keys) / d**0.5
        visible = torch.arange(keys.shape[0])[None, :] <= past + torch.arange(t)[:, None]
        att = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        mid = (
            torch.einsum("hqk,khd->qhd", att, values).reshape(t, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        )
        mid = mid + hidden
        h = _rms(mid, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
        out = mid + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        return _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T, out


# ---- SGLang's LlamaForCausalLMEagle3, run by SGLang's own forward code ----


class _CachedCausalAttention:
    """The attention kernel with a K/V cache: queries see every cached key and the new ones up to their
    own, what the paged backend does for a draft extend followed by chain draft-decode steps."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        past_k, past_v = self.cache.get(layer.layer_id, (k[:0], v[:0]))
        keys, values = torch.cat([past_k, k]), torch.cat([past_v, v])
        self.cache[layer.layer_id] = (keys, values)
        t, past = k.shape[0], past_k.shape[0]
        q = q.view(t, layer.tp_q_head_num, layer.qk_head_dim).transpose(0, 1)
        visible = torch.arange(keys.shape[0])[None, :] <= past + torch.arange(t)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=visible,
            scale=layer.scaling,
            enable_gqa=True,
        )
        return out.transpose(0, 1).reshape(t, -1)


class _Batch:
    def __init__(self, mode, hidden: torch.Tensor) -> None:  # noqa: ANN001
        self.forward_mode = mode
        self.mha_return_lse = False
        self.spec_info = type("SpecInfo", (), {"hidden_states": hidden})()


def test_sglang_loads_the_checkpoint_and_matches_independent_reference(
    eagle3_ckpt: Path, tiny_llama_dir: Path, sglang_single_process
):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.utils.hf_transformers_utils import get_config
    from transformers import AutoModelForCausalLM

    from sglang_dart.train.eagle3_checkpoint import load
    from sglang_dart.train.features import sequence_features

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    embed = target.get_input_embeddings().weight.detach()
    model = LlamaForCausalLMEagle3(get_config(str(eagle3_ckpt), trust_remote_code=False))
    model.load_weights(load_file(str(eagle3_ckpt / "model.safetensors")).items())
    model.set_embed(torch.nn.Parameter(embed.clone(), requires_grad=False))  # as the EAGLE3 worker does
    model.eval()
    drafter, _, vocab = load(eagle3_ckpt, target)
    assert model.get_hot_token_id().tolist() == vocab.target_ids.tolist()

    ids = torch.randint(10, 400, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    taps = sequence_features(target, ids).taps.float()
    n = 20  # draft extend over positions 0..n-1 (taps of p, token p + 1), then two draft decode steps
    tokens = torch.tensor(ids[1:])
    ref = Reference(eagle3_ckpt, embed)
    backend = _CachedCausalAttention()
    previous = set_forward_context(ForwardContext(attn_backend=backend))
    try:
        with torch.inference_mode():
            hidden, pos, mode = taps[:n], torch.arange(n), ForwardMode.EXTEND
            theirs_rows, ref_rows = [], []
            for step in range(3):
                step_tokens = tokens[pos]
                normed, aux = model.model(
                    step_tokens, pos, _Batch(mode, hidden), input_embeds=embed[step_tokens]
                )
                # ParallelLMHead pads its rows; SGLang's logits processor keeps the first draft_vocab_size.
                theirs = (normed @ model.lm_head.weight.T)[:, :DRAFT_VOCAB]
                expected, fed_back = ref.forward(hidden, step_tokens, pos)
                torch.testing.assert_close(theirs, expected, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(aux[0], fed_back, rtol=1e-4, atol=1e-4)
                theirs_rows.append(theirs[-1])
                ref_rows.append(expected[-1])
                # The next draft step: one token at the next position, fed this step's last hidden state.
                hidden, pos, mode = fed_back[-1:], torch.tensor([n + step]), ForwardMode.DECODE
            # The trainer's unrolled forward: step k's row at position n - 1 + k is that decode step.
            mine = drafter.float().ttt_logits(taps[: n + 2], tokens[: n + 2], 3)
    finally:
        set_forward_context(previous)
    for k in range(3):
        torch.testing.assert_close(mine[k][n - 1 + k], ref_rows[k], rtol=1e-4, atol=1e-4)
    assert max(float(r.abs().max()) for r in ref_rows) > 0.1  # not a degenerate all-zero drafter


def test_a_checkpoint_for_another_target_is_refused(
    eagle3_ckpt: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
):
    data = _write_data(tmp_path / "data.jsonl", rows=4)
    other = build_tiny_model(tmp_path_factory.mktemp("six-layers"), arch="llama", num_layers=6)
    with pytest.raises(SystemExit, match="made for a target of 8 layers"):
        _train(other, tmp_path / "a", data, "--init", str(eagle3_ckpt))
    dart = build_random_drafter(tmp_path / "dart", tiny_llama_dir)
    with pytest.raises(SystemExit, match="not an EAGLE3 checkpoint"):
        _train(tiny_llama_dir, tmp_path / "b", data, "--init", str(dart))


def test_a_training_window_computes_on_the_drafters_device():
    """What a --device cuda step runs, on `meta` (a device of its own that computes shapes only): the
    window cut from host features and moved over, the unrolled forward with no tensor made on the host (a
    host tensor meeting a device one raises)."""
    from sglang_dart.train.eagle3_model import Eagle3Drafter, Eagle3Shape
    from sglang_dart.train.eagle3_trainer import window_of
    from sglang_dart.train.features import SequenceFeatures
    from sglang_dart.train.vocab import DraftVocab

    shape = Eagle3Shape(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, vocab_size=100, draft_vocab_size=40,
    )  # fmt: skip
    model = Eagle3Drafter(shape, torch.randn(100, 32)).to("meta")
    feats = SequenceFeatures(
        torch.randint(0, 100, (20,)),
        torch.randn(20, 96).bfloat16(),
        torch.randint(0, 100, (20,)),
        answer_start=5,
    )
    vocab = DraftVocab.of(torch.arange(40) * 2, 100)
    window = window_of(feats, vocab, 2, 16).to("meta")
    assert all(t.device.type == "meta" for t in (window.taps, window.tokens, window.labels))
    logits = model.ttt_logits(window.taps.float(), window.tokens, 3)
    assert [tuple(x.shape) for x in logits] == [(16, 40)] * 3
    assert all(x.device.type == "meta" for x in logits)


def test_acceptance_estimate_of_a_trained_and_an_untrained_eagle3_drafter():
    """The EAGLE3 estimate lines step j's guess up with the target's token j places on: a drafter trained on
    the copy task chains most of its 3 steps on unseen sequences (tau near 4), an untrained one stops at
    once (tau near 1)."""
    from sglang_dart.train.eagle3_model import Eagle3Drafter, Eagle3Shape
    from sglang_dart.train.eagle3_trainer import estimate_acceptance, train
    from sglang_dart.train.trainer import TrainSettings
    from sglang_dart.train.vocab import DraftVocab
    from tests.unit.test_train import _copy_task

    shape = Eagle3Shape(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, vocab_size=50, draft_vocab_size=50,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3Drafter(shape, torch.randn(50, 32, generator=torch.Generator().manual_seed(0)))
    vocab = DraftVocab.of(torch.arange(50), 50)
    held_out = _copy_task(count=6, length=24, seed=3, sequence_seed=9)
    untrained = estimate_acceptance(model, held_out, vocab, ttt_steps=3, k=4, bf16_autocast=False)
    settings = TrainSettings(
        sequences_per_step=2, max_steps=150, warmup_steps=10, learning_rate=3e-3, bf16_autocast=False,
        log_every=0, progress_bar=False,
    )  # fmt: skip
    train(model, _copy_task(count=16, length=24, seed=3), vocab, settings, 3, 64, log=lambda _: None)
    trained = estimate_acceptance(model, held_out, vocab, ttt_steps=3, k=4, bf16_autocast=False)
    # 23 drafted positions a sequence; an anchor counts when all 3 steps' labels lie inside it
    assert trained.sequences == 6 and trained.anchors == 6 * (23 - 3 + 1)
    assert trained.tau_chain > 3.5 and min(trained.top1_by_row) > 0.7, trained
    assert untrained.tau_chain < 1.5 < trained.tau_chain
    for estimate in (trained, untrained):
        assert 1.0 <= estimate.tau_chain <= estimate.tau_topk_bound <= 3 + 1
    assert estimate_acceptance(model, _copy_task(count=2, length=3, seed=4), vocab, ttt_steps=3) is None
