"""fastrlhf's distillation ops against the peers' own code, and trl.patch()'s distillation adapters:

- TRL 1.16 `trainer.distillation_trainer._chunked_divergence_loss` (DistillationTrainer's loss, from both
  models' hidden states and lm_heads): beta 0 / 0.5 / 1, temperature != 1, masked rows, biases, logit
  scales, softcaps, num_items_in_batch, bf16; the loss, entropy sum, valid count and the student's
  gradients. On materialised logits through an identity lm_head, against `ops.distill_loss`.
- TRL's GKD `generalized_jsd_loss`, every reduction.
- Liger 0.8's `LigerFusedLinearJSDFunction` (where its conventions match: no bias, scale or softcap, the
  mask as ignore_index labels, the token mean).
- TRL's DistillationTrainer, one on-policy step on tiny local models, with and without patch().
Each patched result is held to DESIGN.md's rule with the peer as the same-dtype reference and float64
ground truth (reference.py, or the peer in float64 where the peer computes in float64).

From hidden states the teacher is near its student, as in distillation (the student's logits + N(0, 1)).
Far apart (independent models, a reverse KL of ~8 nats) the reverse KL's fp32 gradient is the difference of
two ~8-nat terms and TRL's and fastrlhf's are both ~20 ulps off (the same algorithm: TRL's reads the
normalisers, fastrlhf's cancels them): no factor-2 ordering between two such errors holds element for
element (seen: 2.3x on one d_weight element of one draw). test_distill*.py hold the far case to the
reference-in-fp32 rule.
"""

import pytest
import torch

from fastrlhf import ops
from fastrlhf import reference as ref

from .peer_checks import ATOL, check_like_peer

BETAS = [0.0, 0.5, 1.0]


def _distillation():
    return pytest.importorskip("trl.trainer.distillation_trainer")


def _model(lead, H, V, dtype, bias):
    """[hidden [*lead, H], weight [V, H], bias [V] or None] with logits of std ~2."""
    hidden = torch.randn(*lead, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64) * 2 / H**0.5
    b = torch.randn(V, dtype=torch.float64) if bias else None
    return [None if t is None else t.to(dtype) for t in (hidden, weight, b)]


def _near(student, H, dtype, bias):
    """A teacher near its student, as in distillation: the student's logits plus N(0, 1) (the teacher's hidden
    states are the student's and H - H_s more; its lm_head the student's and a random block)."""
    hs, ws, bs = (None if t is None else t.double() for t in student)
    extra = _model(hs.shape[:-1], H - hs.shape[-1], ws.shape[0], torch.float64, bias)
    extra[1] = extra[1] / 2  # the extra logits: std 1
    hidden = torch.cat([hs, extra[0]], -1)
    weight = torch.cat([ws, extra[1]], -1)
    b = None if bs is None else bs + extra[2] / 2
    return [None if t is None else t.to(dtype) for t in (hidden, weight, b)]


def _leaves(model):
    return [None if t is None else t.detach().clone().requires_grad_() for t in model]


CASES = {  # name: (dtype, biases, keywords of _chunked_divergence_loss)
    "plain": (torch.float32, False, dict(temperature=0.7)),
    "bias_scale_softcap": (torch.float32, True, dict(student_logit_scale=1.3, teacher_final_logit_softcapping=3.0,
                                                     student_final_logit_softcapping=5.0, temperature=1.2)),
    "num_items": (torch.float32, False, dict(num_items_in_batch=torch.tensor(50.0), teacher_logit_scale=0.5)),
    "bf16": (torch.bfloat16, False, dict(temperature=0.9)),
}


def _trl_call(fn, student, teacher, mask, beta, g, kw):
    """TRL's (loss, entropy_sum, n_valid) and the gradients of g * loss for the student's leaves."""
    hs, ws, bs = student
    ht, wt, bt = teacher
    loss, ent_sum, n_valid = fn(hs, ht, ws, wt, mask, beta, student_lm_head_bias=bs, teacher_lm_head_bias=bt,
                                **kw)
    leaves = [t for t in student if t is not None]
    grads = torch.autograd.grad(loss, leaves, g.to(loss.dtype))
    return (loss, ent_sum, n_valid, *grads)


def _truth(student, teacher, mask, beta, g, kw):
    """reference.py in float64 on the same inputs, in the shape of TRL's outputs."""
    student = _leaves([None if t is None else t.double() for t in student])
    hs, ws, bs = student
    ht, wt, bt = (None if t is None else t.double() for t in teacher)
    rename = {"student_final_logit_softcapping": "student_softcap",
              "teacher_final_logit_softcapping": "teacher_softcap", "num_items_in_batch": "global_num_tokens"}
    rkw = {rename.get(k, k): v for k, v in kw.items()}
    loss, stats = ref.linear_distill_loss(hs, ws, ht, wt, mask, beta=beta, student_bias=bs, teacher_bias=bt, **rkw)
    n_valid = (mask != 0).sum()
    grads = torch.autograd.grad(loss, [t for t in student if t is not None], g.double())
    return (loss, stats["entropy"] * n_valid, n_valid, *grads)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("beta", BETAS)
def test_chunked_divergence_loss_matches_trl(trl_integration, backend, op_calls, beta, case):
    """TRL's function, then the patched one (the same name in TRL's module) on the same inputs."""
    module = _distillation()
    dtype, bias, kw = CASES[case]
    B, T, V = 3, 14, 300
    student = _model((B, T), 24, V, dtype, bias)
    teacher = _near(student, 40, dtype, bias)
    mask = (torch.rand(B, T) > 0.25).long()  # TRL's completion_mask: 0/1 integers
    mask[0, 10:] = 0
    mask[1, :3] = 0
    g = torch.randn(()) * mask.sum()
    peer = _trl_call(module._chunked_divergence_loss, _leaves(student), teacher, mask, beta, g, kw)
    truth = _truth(student, teacher, mask, beta, g, kw)
    trl_integration.patch()
    got = _trl_call(module._chunked_divergence_loss, _leaves(student), teacher, mask, beta, g, kw)
    assert op_calls["linear_distill_loss"] == 1
    assert torch.equal(got[2], peer[2]) and got[2].dtype == peer[2].dtype  # the valid count, an integer
    names = ("loss", "entropy_sum", "d_hidden", "d_weight", "d_bias")
    for name, o, p, t in zip(names, got[:2] + got[3:], peer[:2] + peer[3:], truth[:2] + truth[3:]):
        check_like_peer(o, p, t, atol=ATOL[dtype], name=name)


@pytest.mark.parametrize("beta", BETAS)
def test_distill_loss_on_logits_matches_trl(trl_integration, backend, beta):
    """ops.distill_loss on materialised logits against TRL's function given the logits as hidden states
    and an identity lm_head (the same numbers as logits, exactly): loss and d(student logits)."""
    module = _distillation()
    B, T, V = 2, 9, 257
    s = torch.randn(B, T, V) * 2
    t = torch.randn(B, T, V) * 2
    mask = torch.rand(B, T) > 0.3
    g = torch.randn(()) * mask.sum()
    eye = torch.eye(V)
    leaf = s.clone().requires_grad_()
    loss_p, _, _ = module._chunked_divergence_loss(leaf, t, eye, eye, mask, beta, temperature=0.7)
    (grad_p,) = torch.autograd.grad(loss_p, leaf, g)
    leaf = s.clone().requires_grad_()
    loss, _ = ops.distill_loss(leaf, t, mask, beta=beta, temperature=0.7)
    (grad,) = torch.autograd.grad(loss, leaf, g)
    leaf = s.double().requires_grad_()
    loss64, _ = ref.distill_loss(leaf, t.double(), mask, beta=beta, temperature=0.7)
    (grad64,) = torch.autograd.grad(loss64, leaf, g.double())
    check_like_peer(loss, loss_p, loss64, atol=ATOL[torch.float32], name="loss")
    check_like_peer(grad, grad_p, grad64, atol=ATOL[torch.float32], name="d_student_logits")


def _gkd():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("trl.experimental.gkd.gkd_trainer").GKDTrainer


@pytest.mark.parametrize("reduction,labels,num_items", [("batchmean", True, None), ("batchmean", False, None),
                                                        ("sum", True, None), ("mean", True, None),
                                                        ("mean", False, None), ("batchmean", True, 11),
                                                        ("none", True, None)])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gkd_generalized_jsd_loss(trl_integration, backend, op_calls, beta, reduction, labels, num_items):
    """GKD's loss, patched: float32 held to the rule against GKD in float64; float64 on the torch path to
    float64 precision; reduction="none" (a per-element output) is GKD's own."""
    GKD = _gkd()
    original = GKD.generalized_jsd_loss
    s, t = torch.randn(3, 7, 50) * 2, torch.randn(3, 7, 50) * 2
    y = torch.randint(0, 50, (3, 7))
    y[0, :3] = -100
    y[2] = -100
    kw = dict(labels=y if labels else None, beta=beta, temperature=0.8, reduction=reduction,
              num_items_in_batch=num_items)

    upstream = {}

    def run(fn, dtype):
        leaf = s.to(dtype).requires_grad_()
        out = fn(leaf, t.to(dtype), **kw)
        g = upstream.setdefault("g", torch.randn(out.shape, dtype=torch.float64) * 40)  # one draw for every run
        (grad,) = torch.autograd.grad(out, leaf, g.to(dtype))
        return out, grad

    peer, peer64 = run(original, torch.float32), run(original, torch.float64)
    trl_integration.patch()
    assert GKD.generalized_jsd_loss is not original
    got, got64 = run(GKD.generalized_jsd_loss, torch.float32), run(GKD.generalized_jsd_loss, torch.float64)
    # float32 runs fused; float64 too on the torch path (on the kernels, which compute in float32, GKD's own)
    fused = 0 if reduction == "none" else 2 if backend == "torch" else 1
    assert op_calls["distill_loss"] == fused
    for name, o, p, p64 in zip(("loss", "d_student_logits"), got, peer, peer64):
        check_like_peer(o, p, p64, atol=ATOL[torch.float32], name=name)
    for name, o, p64 in zip(("loss64", "d_student_logits64"), got64, peer64):
        check_like_peer(o, p64, p64, atol=ATOL[torch.float64], name=name)


@pytest.mark.parametrize("beta", BETAS)
def test_liger_fused_linear_jsd(backend, beta):
    """Liger's fused linear JSD: its beta, temperature and token mean are TRL's and fastrlhf's; its mask is
    the labels' ignore_index; it has no bias, logit scale, softcap or divisor argument (not compared)."""
    liger = pytest.importorskip("liger_kernel.ops.fused_linear_jsd")
    N, V = 37, 300
    student, teacher = _model((N,), 24, V, torch.float32, False), _model((N,), 40, V, torch.float32, False)
    labels = torch.randint(0, V, (N,))
    labels[:5] = labels[20:23] = -100
    mask = labels != -100
    g = torch.randn(()) * mask.sum()

    def run(fn, model):
        hs, ws = _leaves(model[:2])
        loss = fn(hs, ws)
        return (loss, *torch.autograd.grad(loss, (hs, ws), g.to(loss.dtype)))

    ht, wt, _ = teacher
    peer = run(lambda hs, ws: liger.LigerFusedLinearJSDFunction.apply(hs, ws, ht, wt, labels, beta, -100, 0.8),
               student)
    got = run(lambda hs, ws: ops.linear_distill_loss(hs, ws, ht, wt, mask, beta=beta, temperature=0.8)[0], student)
    truth = run(lambda hs, ws: ref.linear_distill_loss(hs, ws, ht.double(), wt.double(), mask, beta=beta,
                                                       temperature=0.8)[0], [t.double() for t in student[:2]])
    for name, o, p, t in zip(("loss", "d_hidden", "d_weight"), got, peer, truth):
        check_like_peer(o, p, t, atol=ATOL[torch.float32], name=name)


# ---------------------------------------------------------------- TRL's DistillationTrainer


def _tiny(vocab_size, hidden, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _materialised_divergence(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                             teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                             student_lm_head_bias=None, teacher_lm_head_bias=None, temperature=1.0, **unused):
    """Test truth for TRL's `_chunked_divergence_loss` in float64: reference.py on materialised logits
    (TRL's own function projects in float32 whatever the inputs)."""
    assert all(v in (None, 1.0) for v in unused.values()), unused
    loss, stats = ref.linear_distill_loss(
        student_hidden_states, student_lm_head_weight, teacher_hidden_states, teacher_lm_head_weight,
        completion_mask != 0, beta=beta, student_bias=student_lm_head_bias, teacher_bias=teacher_lm_head_bias,
        temperature=temperature, global_num_tokens=num_items_in_batch)
    n_valid = (completion_mask != 0).sum()
    return loss, (stats["entropy"] * n_valid).detach(), n_valid


def _distill_run(tmp_path, integration, use_patch, dtype=torch.float32):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from fastrlhf.train.task import build_char_tokenizer

    (integration.patch if use_patch else integration.unpatch)()
    tok = build_char_tokenizer()
    paths = {}
    for name, hidden, seed in (("student", 32, 0), ("teacher", 48, 1)):
        paths[name] = tmp_path / name
        _tiny(len(tok), hidden, seed).to(dtype).save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    prompts = Dataset.from_dict({"prompt": ["abc ", "key: d ", "hello ", "xyz "]})
    args = DistillationConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                              max_completion_length=6, max_steps=1, learning_rate=1e-3, logging_steps=1,
                              report_to=[], use_cpu=True, seed=0, save_strategy="no", beta=0.5, temperature=0.9,
                              disable_tqdm=True, dataloader_num_workers=0, model_init_kwargs={"dtype": dtype},
                              teacher_model_init_kwargs={"dtype": str(dtype).removeprefix("torch.")},
                              **({} if dtype == torch.float32 else {"bf16": False}))
    trainer = DistillationTrainer(model=str(paths["student"]), teacher_model=str(paths["teacher"]), args=args,
                                  train_dataset=prompts, processing_class=tok)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_distillation_trainer_first_step(trl_integration, tmp_path, op_calls, monkeypatch):
    """One on-policy DistillationTrainer step (student generation, teacher and student hidden states, the
    chunked JSD at beta 0.5) with and without patch(). Its batch is sampled from the initial weights, which
    the loss does not touch, so the runs differ only by the loss's arithmetic: the logged loss, gradient
    norm and entropy are each held to DESIGN.md's rule against TRL's trainer in float64 with the loss on
    materialised logits (reference.py): no further from it than twice TRL's own error, plus float32's atol."""
    module = _distillation()
    (p,) = _distill_run(tmp_path / "p", trl_integration, use_patch=True)
    assert op_calls["linear_distill_loss"] == 1  # the trainer's loss ran through fastrlhf
    (o,) = _distill_run(tmp_path / "o", trl_integration, use_patch=False)
    monkeypatch.setattr(module, "_chunked_divergence_loss", _materialised_divergence)
    (t,) = _distill_run(tmp_path / "t", trl_integration, use_patch=False, dtype=torch.float64)
    assert op_calls["linear_distill_loss"] == 1
    assert p.keys() == o.keys() == t.keys()
    for k in ("loss", "grad_norm", "entropy"):
        check_like_peer(p[k], o[k], t[k], atol=ATOL[torch.float32], name=k)
    assert p["loss"] > 0


@pytest.mark.parametrize("tail_bucket", [True, False])
@pytest.mark.parametrize("beta", BETAS)
def test_topk_matches_trl_async_distillation(backend, beta, tail_bucket):
    """ops.topk_distill_loss against TRL's async distillation loss on a teacher's top-K candidates
    (`_jsd_loss_chunk`, given the logits through an identity lm_head; its loss is the sum over the chunk's
    tokens: global_num_tokens=1). TRL mixes JSD's m in probability space with a floor at fp32's tiny, fastrlhf
    in log space: the same for every probability above 1e-38."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trl_async = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
    N, V, K = 30, 257, 6
    s = torch.randn(N, V) * 2
    top = (torch.randn(N, V, dtype=torch.float64) * 2).log_softmax(-1).topk(K, dim=-1)
    ids, t_lp = top.indices.clone(), top.values.float()
    ids[3, K - 2:] = -1
    valid = ids >= 0
    eye = torch.eye(V)
    g = torch.randn(()) * N

    def run(fn, logits):
        leaf = logits.clone().requires_grad_()
        loss = fn(leaf)
        return loss, torch.autograd.grad(loss, leaf, g.to(loss.dtype))[0]

    peer = run(lambda x: trl_async._jsd_loss_chunk(x, eye, None, 1.0, None, ids, t_lp, valid, beta, 0.9, tail_bucket,
                                                   None, 1)[0], s)
    kw = dict(beta=beta, temperature=0.9, tail_bucket=tail_bucket, global_num_tokens=1)
    got = run(lambda x: ops.topk_distill_loss(x, ids, t_lp, torch.ones(N), **kw)[0], s)
    truth = run(lambda x: ref.topk_distill_loss(x, ids, t_lp.double(), torch.ones(N), **kw)[0], s.double())
    for name, o, p, t in zip(("loss", "d_student_logits"), got, peer, truth):
        check_like_peer(o, p, t, atol=ATOL[torch.float32], name=name)
