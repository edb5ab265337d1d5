"""`python -m sglang_dart.train --format dflash` writes a checkpoint that SGLang's `DFlashDraftModel` loads
(its `load_weights`, its config parsing) and that computes, through SGLang's forward code, the logits an
independent plain-torch DFLASH drafter written here computes (and the trainer's module too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_dart.train.__main__ import main as train_main
from sglang_dart.train.features import tap_layers
from tests.support.tiny_models import build_tiny_model, training_corpus

BLOCK = 4


def _write_data(path: Path, rows: int = 12) -> Path:
    texts = [t[:600] for t in training_corpus(rows)]
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return path


def _train(target: Path, out: Path, data: Path, *extra: str) -> None:
    train_main(
        [
            "--format", "dflash", "--target", str(target), "--data", str(data), "--out", str(out),
            "--max-steps", "3", "--anchors", "8", "--sequences-per-step", "2", "--max-len", "96",
            "--dflash-block-size", str(BLOCK), "--dflash-num-layers", "2", "--no-bf16", "--holdout", "0.2",
            *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def dflash_ckpt(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dflash")
    _train(tiny_llama_dir, root / "draft", _write_data(root / "data.jsonl"))
    return root / "draft"


# ---- an independent DFLASH drafter in plain torch, straight from the checkpoint's tensors ----


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # x [N, heads, D]
    half = x.shape[-1] // 2
    freq = pos.double()[:, None] / theta ** (torch.arange(half).double() * 2 / x.shape[-1])
    cos, sin = freq.cos()[:, None, :].float(), freq.sin()[:, None, :].float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_logits(
    ckpt: Path,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    taps: torch.Tensor,
    tokens: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Logits [B, V] of one block (tokens at positions start..start+B-1) seeing the context taps[:start]."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = load_file(str(ckpt / "model.safetensors"))
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx = _rms(taps[:start] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos, blk_pos = torch.arange(start), torch.arange(start, start + tokens.shape[0])
    x = embed[tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)

        def proj(src: torch.Tensor, name: str, heads: int, p: str = p) -> torch.Tensor:
            return (src @ w[p + f"self_attn.{name}.weight"].T).view(src.shape[0], heads, d)

        q = _rotate(_rms(proj(h, "q_proj", nh), w[p + "self_attn.q_norm.weight"], eps), blk_pos, theta)
        keys = [
            _rotate(_rms(proj(src, "k_proj", nkv), w[p + "self_attn.k_norm.weight"], eps), pos, theta)
            for src, pos in ((ctx, ctx_pos), (h, blk_pos))
        ]
        k = torch.cat(keys).repeat_interleave(nh // nkv, dim=1)
        v = torch.cat([proj(ctx, "v_proj", nkv), proj(h, "v_proj", nkv)]).repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d**0.5, dim=-1)  # every key visible
        x = (
            x
            + torch.einsum("hqk,khd->qhd", att, v).reshape(x.shape[0], -1)
            @ w[p + "self_attn.o_proj.weight"].T
        )
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps) @ lm_head.T


# ---- SGLang's DFlashDraftModel, run by SGLang's own forward code ----


class _BlockAttention:
    """The attention kernel for one block (what the serving backend does with the paged KV pool): queries
    see the context K/V the worker materialised plus the block's own K/V, with no causal mask."""

    def __init__(self, context_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.context_kv = context_kv

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        ctx_k, ctx_v = self.context_kv[layer.layer_id]
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim).transpose(0, 1)
        keys = torch.cat([ctx_k, k]).transpose(0, 1)
        values = torch.cat([ctx_v, v]).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, scale=layer.scaling, enable_gqa=q.shape[0] != keys.shape[0]
        )
        return out.transpose(0, 1).reshape(q.shape[1], -1)


def sglang_logits(ckpt: Path, embed, lm_head, taps, tokens, start) -> torch.Tensor:  # noqa: ANN001
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.utils.hf_transformers_utils import get_config

    model = DFlashDraftModel(get_config(str(ckpt), trust_remote_code=False))
    model.load_weights(load_file(str(ckpt / "model.safetensors")).items())
    model.eval()
    assert model.block_size == BLOCK
    with torch.inference_mode():
        # The context K/V, as DFlashWorkerV2._append_target_hidden_sequential materialises it.
        ctx = model.project_target_hidden(taps[:start])
        ctx_pos = torch.arange(start)
        context_kv = {}
        for layer in model.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
            k = attn.apply_k_rope(ctx_pos, attn.apply_k_norm(k))
            shape = (-1, attn.num_kv_heads, attn.head_dim)
            context_kv[attn.attn.layer_id] = (k.reshape(shape), v.reshape(shape))
        batch = type("Batch", (), {"forward_mode": ForwardMode.TARGET_VERIFY, "mha_return_lse": False})()
        previous = set_forward_context(ForwardContext(attn_backend=_BlockAttention(context_kv)))
        try:
            positions = torch.arange(start, start + tokens.shape[0])
            out = model(tokens, positions, batch, input_embeds=embed[tokens])
        finally:
            set_forward_context(previous)
    return out.hidden_states @ lm_head.T


def test_checkpoint_loads_in_sglang_and_matches_independent_reference(
    dflash_ckpt, tiny_llama_dir, sglang_single_process
):
    from transformers import AutoModelForCausalLM

    from sglang_dart.train.dflash_train import FrozenTarget, block_logits
    from sglang_dart.train.features import sequence_features
    from sglang_dart.train.peer_dflash import load

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    config = json.loads((dflash_ckpt / "config.json").read_text())
    mask_id = config["dflash_config"]["mask_token_id"]
    ids = torch.randint(10, 400, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    feats = sequence_features(target, ids)
    taps = feats.taps.float()
    drafter, _ = load(dflash_ckpt)
    frozen = FrozenTarget(embed=embed, lm_head=lm_head)
    for start in (1, 17, 39):
        tokens = torch.tensor([ids[start]] + [mask_id] * (BLOCK - 1))
        ref = reference_logits(dflash_ckpt, embed, lm_head, taps, tokens, start)
        theirs = sglang_logits(dflash_ckpt, embed, lm_head, taps, tokens, start)
        feats.taps = taps
        mine = block_logits(drafter.float(), frozen, feats, torch.tensor([start]), BLOCK, mask_id)[0]
        torch.testing.assert_close(theirs, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mine, ref[1:], rtol=1e-4, atol=1e-4)
        assert ref.abs().max() > 0.1  # not a degenerate all-zero drafter


def test_config_is_what_sglang_reads(dflash_ckpt, tiny_llama_dir):
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config
    from transformers import AutoTokenizer

    parsed = parse_dflash_draft_config(draft_hf_config=get_config(str(dflash_ckpt), trust_remote_code=False))
    target = json.loads((tiny_llama_dir / "config.json").read_text())
    layers = target["num_hidden_layers"]
    assert parsed.block_size == BLOCK and parsed.num_hidden_layers == 2
    # SGLang captures the hidden state entering layer id + 1: exactly the taps the trainer learned from.
    ids = parsed.resolve_target_layer_ids(target_num_layers=layers)
    assert [i + 1 for i in ids] == tap_layers(layers)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert 0 <= parsed.mask_token_id < target["vocab_size"]
    assert tokenizer.convert_ids_to_tokens(parsed.mask_token_id) == parsed.mask_token
    assert parsed.mask_token_id in tokenizer.added_tokens_decoder  # a special token, unused by the text
    report = json.loads((dflash_ckpt / "train_report.json").read_text())
    assert report["format"] == "dflash" and report["steps"] == 3 and report["held_out"]["tau"] >= 1.0


def test_mask_id_outside_the_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    with pytest.raises(SystemExit, match="outside the target's vocabulary"):
        _train(
            tiny_llama_dir,
            tmp_path / "out",
            _write_data(tmp_path / "d.jsonl", 4),
            "--dflash-mask-token-id",
            str(vocab),
        )
    assert not (tmp_path / "out").exists()


def test_checkpoint_for_another_target_is_refused(dflash_ckpt, tmp_path):
    other = build_tiny_model(tmp_path / "six-layers", num_layers=6)
    data = _write_data(tmp_path / "d.jsonl", 4)
    with pytest.raises(SystemExit, match="not a DFLASH drafter for this target: num_target_layers 8"):
        _train(other, tmp_path / "out", data, "--init", str(dflash_ckpt))
    assert not (tmp_path / "out").exists()


def test_an_anchor_block_step_computes_on_the_drafters_device():
    """What a --device cuda step runs, on `meta` (a device of its own that computes shapes only): features
    and the frozen target tensors there, anchors drawn on the host, no tensor made on the host in the block
    forward or its labels (a host tensor meeting a device one raises)."""
    from sglang_dart.train.dflash_model import DFlashDrafter, DFlashShape
    from sglang_dart.train.dflash_train import FrozenTarget, block_labels, block_logits
    from sglang_dart.train.features import SequenceFeatures

    shape = DFlashShape(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2,
        num_context_features=3, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    model = DFlashDrafter(shape).to("meta")
    frozen = FrozenTarget(
        embed=torch.empty(100, 32, device="meta"), lm_head=torch.empty(100, 32, device="meta")
    )
    feats = SequenceFeatures(
        torch.randint(0, 100, (20,)), torch.randn(20, 96).bfloat16(), torch.randint(0, 100, (20,))
    ).to("meta")
    anchors = torch.tensor([3, 8, 15])  # as the trainer draws them: on the host
    logits = block_logits(model, frozen, feats, anchors, BLOCK, 7)
    labels = block_labels(feats, anchors, BLOCK)
    assert tuple(logits.shape) == (3, BLOCK - 1, 100) and logits.device.type == "meta"
    assert tuple(labels.shape) == (3, BLOCK - 1) and labels.device.type == "meta"


def test_acceptance_estimate_of_a_trained_and_an_untrained_dflash_drafter():
    """The DFLASH estimate lines block position j's guess up with the target's token j places past the
    anchor: a drafter trained on the copy task chains most of its block on unseen sequences (tau over
    BLOCK - 1), an untrained one stops at once (tau near 1); only blocks whose every position has a label
    count."""
    from sglang_dart.train.dflash_model import DFlashDrafter, DFlashShape
    from sglang_dart.train.dflash_train import FrozenTarget, estimate_acceptance, train
    from sglang_dart.train.trainer import TrainSettings
    from tests.unit.test_train import _copy_task

    shape = DFlashShape(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1,
        num_context_features=3, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    frozen = FrozenTarget(
        embed=torch.randn(50, 32, generator=gen), lm_head=torch.randn(50, 32, generator=gen)
    )
    torch.manual_seed(0)
    model = DFlashDrafter(shape)
    mask_id = 49
    held_out = _copy_task(count=6, length=24, seed=3, sequence_seed=9)
    untrained = estimate_acceptance(model, frozen, held_out, BLOCK, mask_id, bf16_autocast=False)
    settings = TrainSettings(
        sequences_per_step=2, max_steps=150, warmup_steps=10, learning_rate=3e-3, bf16_autocast=False,
        log_every=0, progress_bar=False,
    )  # fmt: skip
    train(
        model, frozen, _copy_task(count=16, length=24, seed=3), settings, BLOCK, mask_id, log=lambda _: None
    )
    trained = estimate_acceptance(model, frozen, held_out, BLOCK, mask_id, bf16_autocast=False)
    # anchors 1..24 - BLOCK + 1: the last block's final position drafts the sequence's last token
    assert trained.sequences == 6 and trained.anchors == 6 * (24 - BLOCK + 1)
    assert trained.tau > BLOCK - 1 and min(trained.top1_by_position) > 0.7, trained
    assert untrained.tau < 1.5 < trained.tau
    assert len(trained.top1_by_position) == BLOCK - 1
    too_short = _copy_task(count=2, length=BLOCK - 2, seed=4)
    assert estimate_acceptance(model, frozen, too_short, BLOCK, mask_id, bf16_autocast=False) is None
