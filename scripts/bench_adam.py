"""Compression with AdamW on a transformer: gradients exchanged (today's mode) against Adam's
momentum exchanged with the variance frozen (``exchange_momentum_after``), paired by seed with
uncompressed AdamW; validation loss and the bits each element costs over the whole run.

Model: ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (4 layers, 256 wide, 4 heads,
64-byte context, 256-symbol vocabulary: 3.2 M parameters, no download), byte-level, on CPython's
standard-library sources (``bench_convergence.load_stdlib_bytes``: 90 % train, 10 % held out;
the loss reported is the mean of the last four evaluations).  ``--model llama``: transformers'
Llama instead (rotary positions, RMSNorm, SwiGLU 688 wide, untied embeddings, no biases; 3 layers:
2.5 M parameters against GPT-2's 2.45 M); ``--corpus prose``: the Python reference's English
text from ``pydoc_data.topics`` (466 KB) instead of the sources.  AdamW (lr 1e-3, betas 0.9/0.999,
weight decay 0.1), a linear LR warm-up over the first 5 % of the steps then a cosine decay to
10 %; 2 workers (gloo over loopback) x batch 8, ``groups=1``.

A configuration is ``COMPRESSOR[:key=value;...]@MODE``, MODE ``grad`` (gradients exchanged,
the compressor's default memory), ``auto`` (``exchange_momentum_after="auto"``: the compressor's
recipe, scaled to the LR warm-up; a compressor named without settings takes the recipe's) or
``momentum`` (``exchange_momentum_after=--after``, lossless
warm-up; ``momentum/R``: with ``variance_refresh_every=R``) or ``increment`` (the same with
``exchange_momentum_as="increment"``: only the gradient's share of the momentum sent), each with
``+MEMORY[:key=value;...]`` for another error-feedback memory (``grad+averaged``,
``momentum+residual:beta=0.9/64``), and with a suffix ``^fp16`` or ``^qsgd`` for the warm-up
and the refreshes sent as fp16 or 8-bit QSGD (``compression_warmup_codec``).  ``none@grad`` is
the baseline and runs unless ``--no-baseline``.  Bits per element count the warm-up and
refreshes at 32 (16 with ``^fp16``, 8.06 with ``^qsgd``).

    python scripts/bench_adam.py --json docs/img/data/adam_gpt2_4x256_stdlib_bytes_2workers.jsonl
    python scripts/bench_adam.py --configs onebit@momentum,topk@momentum --steps 500 --seeds 0
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import types

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_convergence import StdlibBytes, compressor_of, free_port, load_stdlib_bytes, memory_of  # noqa: E402

CONFIGS = ("none@momentum,onebit@grad,onebit@grad+averaged,onebit@momentum,efsignsgd@momentum,topk@momentum,"
           "powersgd@momentum,qsgd@momentum")
CONTEXT, BATCH, LR, DECAY, EVAL_EVERY = 64, 8, 1e-3, 0.1, 50
TARGET = 0.01  # within 1 % of uncompressed AdamW's validation loss
BASELINE = "none@grad"
MODELS, CORPORA = ("gpt2", "llama", "convnet"), ("stdlib", "prose")
FRONTENDS = ("optimizer", "trainer", "accelerate", "lightning")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--configs", default=CONFIGS, help="comma list of COMPRESSOR[:args]@MODE")
parser.add_argument("--steps", type=int, default=2000)
parser.add_argument("--after", type=int, default=60, help="exchange_momentum_after (warm-up updates)")
parser.add_argument("--seeds", default="0,1,2")
parser.add_argument("--json", default=None, help="append one JSON record (with its curve) per run")
parser.add_argument("--no-baseline", action="store_true", help=f"do not run {BASELINE} (its records are in --json)")
parser.add_argument("--report", default=None, help="print the table from the records of earlier --json runs")
parser.add_argument("--layers", type=int, default=4, help="the model's layers")
parser.add_argument("--model", choices=MODELS, default="gpt2",
                    help="gpt2 (learned positions, LayerNorm, GELU, tied embeddings) or llama (rotary positions, "
                         "RMSNorm, SwiGLU, untied, no biases), 256 wide, 4 heads either way; or convnet, a causal "
                         "convolutional ResNet without attention (CausalConvNet)")
parser.add_argument("--corpus", choices=CORPORA, default="stdlib",
                    help="stdlib (CPython's library sources) or prose (the Python reference's English text that "
                         "ships in pydoc_data)")
parser.add_argument("--lr", type=float, default=LR, help="AdamW's peak learning rate")
parser.add_argument("--beta2", type=float, default=0.999, help="AdamW's beta2")
parser.add_argument("--clip", type=float, default=None,
                    help="clip_grad_norm_ to this after synchronize(), step() inside skip_synchronize()")
parser.add_argument("--batch", type=int, default=BATCH, help="windows per rank per step")
parser.add_argument("--workers", type=int, default=2, help="ranks (gloo over loopback)")
parser.add_argument("--frontend", choices=FRONTENDS, default="optimizer",
                    help="optimizer: mc.DistributedOptimizer around AdamW (the loop above); trainer: the transformers "
                         "Trainer's own AdamW (adamw_torch), warm-up and cosine schedule and clipping (max_grad_norm "
                         "1.0 unless --clip), with register(trainer, COMPRESSOR) (its default, 'auto') for "
                         "@auto configurations and plain DDP for none@grad; accelerate: the loop above through "
                         "Accelerate's prepare, backward and clip_grad_norm_ (--clip), with register(accelerator, "
                         "model, COMPRESSOR, optimizer=opt) (its default, 'auto') or plain DDP the same way; "
                         "lightning: the same loop as a LightningModule, gradient_clip_val=--clip, with "
                         "MergecompDDPStrategy(COMPRESSOR) (its default, 'auto') or Lightning's DDPStrategy")
parser.add_argument("--trace", action="store_true",
                    help="record each update's RMS over the parameters of (change / lr) in the record's 'trace'")


class CausalConvNet(torch.nn.Module):
    """A byte-level convolutional ResNet, no attention (``--model convnet``): a 256-wide byte
    embedding, ``layers`` residual blocks (LayerNorm over the channels, a causal convolution
    256 -> 512 of width 5 dilated 1, 2, 4, ..., GELU, a 1 x 1 convolution back to 256), LayerNorm
    and an untied head.  ``forward(input_ids, labels)`` as a transformers causal LM: ``.loss``,
    the next byte's cross-entropy."""

    WIDTH, INNER, KERNEL = 256, 512, 5

    def __init__(self, layers):
        super().__init__()
        nn = torch.nn
        self.embed = nn.Embedding(256, self.WIDTH)
        self.norms = nn.ModuleList(nn.LayerNorm(self.WIDTH) for _ in range(layers))
        self.convs = nn.ModuleList(nn.Conv1d(self.WIDTH, self.INNER, self.KERNEL, dilation=2 ** i)
                                   for i in range(layers))
        self.outs = nn.ModuleList(nn.Conv1d(self.INNER, self.WIDTH, 1) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(self.WIDTH), nn.Linear(self.WIDTH, 256)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)  # (batch, positions, width)
        for norm, conv, out in zip(self.norms, self.convs, self.outs):
            h = norm(x).transpose(1, 2)
            h = conv(torch.nn.functional.pad(h, ((self.KERNEL - 1) * conv.dilation[0], 0)))  # sees the past only
            x = x + out(torch.nn.functional.gelu(h)).transpose(1, 2)
        logits = self.head(self.norm(x))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss, logits=logits)


def make_model(layers=4, family="gpt2"):
    """A byte-level decoder, 256 wide, 4 heads, ``CONTEXT`` positions, built from its config
    (``convnet``: :class:`CausalConvNet`)."""
    if family == "convnet":
        return CausalConvNet(layers)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=CONTEXT,
                             bos_token_id=0, eos_token_id=0, pad_token_id=None)
        return LlamaForCausalLM(config)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=256, n_layer=layers, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def load_prose_bytes():
    """The Python language reference's English text (``pydoc_data.topics``, shipped with
    CPython) as one uint8 tensor: (train, held out), 90 % / 10 %."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics)).encode()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def lr_warmup(steps):
    """The LR warm-up of :func:`schedule`: 5 % of the steps."""
    return max(1, steps // 20)


def schedule(steps, warm=None):
    """Linear warm-up over ``warm`` steps (default :func:`lr_warmup`), then cosine decay to 10 %
    of the peak."""
    warm = warm or lr_warmup(steps)
    return lambda t: (t + 1) / warm if t < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (t - warm) / (steps - warm)))


def parse_config(config):
    """``COMPRESSOR[:args]@MODE[+MEMORY[:args]][/R][^CODEC]`` -> (compressor spec, mode, memory
    spec or None, refresh interval R or None, warm-up codec or None)."""
    spec, _, mode = config.partition("@")
    mode, _, warmup_codec = mode.partition("^")
    mode, _, refresh = mode.partition("/")
    mode, _, memory = mode.partition("+")
    return spec, mode, memory or None, int(refresh) if refresh else None, warmup_codec or None


def exchange_options(config, steps, after, warm=None):
    """What ``config`` asks of mergecomp, for ``mc.DistributedOptimizer`` or ``mc.ddp_comm_hook``
    alike: (compression, keyword options, mode, refresh interval or None).  ``after``: the
    warm-up of ``@momentum`` / ``@increment``; ``@auto`` takes the run's ``steps`` and LR
    warm-up ``warm`` (default :func:`lr_warmup`)."""
    spec, mode, memory, refresh, warmup_codec = parse_config(config)
    kwargs = {"compression_warmup_codec": warmup_codec} if warmup_codec else {}
    if memory:
        kwargs["memory"] = memory_of(memory)
    if mode == "grad":
        kwargs["exchange_momentum_after"] = None  # the gradients, as asked (not the default's momentum)
    if mode in ("momentum", "increment"):
        kwargs.update(exchange_momentum_after=after, variance_refresh_every=refresh, exchange_momentum_as=mode)
    if mode == "auto":  # the compressor's recipe, scaled to the run and its LR warm-up
        kwargs.update(exchange_momentum_after="auto", lr_warmup_steps=warm or lr_warmup(steps), total_steps=steps)
    compression = spec if mode == "auto" and ":" not in spec else compressor_of(spec)
    return compression, kwargs, mode, refresh


def wrap_adamw(model, config, steps, after, groups=1, warm=None, lr=LR, beta2=0.999):
    """AdamW (lr ``lr``, betas 0.9 / ``beta2``, weight decay ``DECAY``) in
    ``mc.DistributedOptimizer`` as ``config`` says (:func:`exchange_options`), with the LR
    schedule of ``steps`` steps (its warm-up ``warm``): (optimizer, scheduler, refresh interval or
    None)."""
    import mergecomp.torch as mc

    compression, kwargs, mode, refresh = exchange_options(config, steps, after, warm)
    adamw = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, beta2), weight_decay=DECAY)
    opt = mc.DistributedOptimizer(adamw, model.named_parameters(), compression=compression, groups=groups,
                                  **kwargs)
    refresh = opt.momentum_exchange.refresh_every if mode == "auto" else refresh
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps, warm)), refresh


def bits_over_run(merged, shapes, steps, momentum):
    """Bits per element sent over the ``steps`` steps just run by ``merged`` (a
    ``DistributedOptimizer``'s ``opt.merged``, or a DDP hook state's ``state.merged``) for tensors
    of ``shapes``: the warm-up's and the variance refreshes' (those ``momentum``, the run's
    ``MomentumExchange`` or None, sent) at their codec's bits (32, 16 as fp16, 8.06 or 4.06 as
    QSGD), the compressor's on the other steps."""
    import mergecomp

    exact = min(merged.warmup_steps, steps) + (momentum.refreshes if momentum is not None else 0)
    numel = sum(s.numel() for s in shapes)
    compressed = mergecomp.bits_per_element(merged.exchange.compressor, numel, shapes=shapes)
    warmup_bits = mergecomp.bits_per_element(warmup_compressor(merged), numel, shapes=shapes)
    return (exact * warmup_bits + (steps - exact) * compressed) / steps


def warmup_compressor(merged):
    """The compressor of the warm-up and of the variance refreshes of a merged step."""
    from mergecomp.exchange.plan import COMPRESSED

    return merged.route(COMPRESSED, compressing=False).compressor


def scheduled_adamw(params, args):
    """Plain AdamW (``--lr``, betas 0.9 / ``--beta2``, weight decay ``DECAY``) and its LR
    schedule over ``--steps`` updates (:func:`schedule`), for a framework's run."""
    adamw = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, args.beta2), weight_decay=DECAY)
    return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, schedule(args.steps))


def evaluate(model, held_out, step, steps, curve, began):
    """After update ``step`` of ``steps``: every ``EVAL_EVERY`` updates and at the last, the
    validation loss on ``held_out`` appended to ``curve`` with the seconds since ``began``."""
    if step % EVAL_EVERY == 0 or step == steps:
        with torch.no_grad():
            loss = model(input_ids=held_out, labels=held_out).loss.item()
        curve.append({"step": step, "test_loss": loss, "seconds": time.perf_counter() - began})


def rank_data(rank, world, held_out_windows=64, corpus="stdlib"):
    """This rank's share of the training bytes of ``corpus`` (:data:`CORPORA`) and the held-out
    windows every rank evaluates on: (1-D int64, (held_out_windows, CONTEXT) int64)."""
    train, held = load_prose_bytes() if corpus == "prose" else load_stdlib_bytes()
    per = len(train) // world
    starts = torch.linspace(0, len(held) - CONTEXT - 1, held_out_windows).long()
    return train[rank * per:(rank + 1) * per], torch.stack([held[s:s + CONTEXT] for s in starts])


def random_windows(train, generator, batch=BATCH):
    """``batch`` windows of ``CONTEXT`` bytes at random offsets of ``train``: (batch, CONTEXT) int64."""
    starts = torch.randint(len(train) - CONTEXT, (batch,), generator=generator)
    return torch.stack([train[s:s + CONTEXT] for s in starts.tolist()])


def run_one(rank, world, config, seed, args, data):
    import mergecomp.torch as mc

    train, held_out = data
    torch.manual_seed(seed)
    model = make_model(args.layers, args.model)
    opt, lr_schedule, refresh = wrap_adamw(model, config, args.steps, args.after, lr=args.lr, beta2=args.beta2)
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    numel = sum(p.numel() for p in model.parameters())
    curve, trace, began = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        if args.trace:
            before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            lr = opt.param_groups[0]["lr"]
        windows = random_windows(train, gen, args.batch)
        opt.zero_grad()
        model(input_ids=windows, labels=windows).loss.backward()
        if args.clip is None:
            opt.step()
        else:  # the README's clipping: synchronize, clip, step inside skip_synchronize
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            with opt.skip_synchronize():
                opt.step()
        if args.trace:
            after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            trace.append((after - before).div_(lr).square().mean().sqrt().item())
        lr_schedule.step()
        evaluate(model, held_out, step, args.steps, curve, began)
    opt.remove_hooks()
    held = lambda holder: sum(t.nbytes for fields in holder.state.values() for t in fields.values())  # noqa: E731
    state_mb = {"adam": sum(t.nbytes for st in opt.state.values() for t in st.values() if torch.is_tensor(t)) / 1e6,
                "error_feedback": sum(held(h) for k, h in opt.exchange.holders().items() if k != "compressor") / 1e6,
                "compressor": held(opt.compressor) / 1e6,
                "group_buffers": sum(b.nbytes for b in opt.merged.buffers) / 1e6}
    after = opt.momentum_exchange.after if opt.momentum_exchange is not None else None
    return {"config": config, "seed": seed, "steps": args.steps, "after": after,
            "compressor": repr(opt.compressor), "memory": repr(opt.memory), "parameters": numel,
            "warmup_codec": repr(warmup_compressor(opt.merged)),
            "refresh": refresh, "bits_per_element": bits_over_run(
                opt.merged, [p.shape for group in opt.param_groups for p in group["params"]], args.steps,
                opt.momentum_exchange),
            "final_test_loss": StdlibBytes.final_loss(curve), "curve": curve, "trace": trace,
            "state_mb": state_mb, "wall_s": time.perf_counter() - began, "status": "ok",
            "setting": {"model": args.model, "corpus": args.corpus, "layers": args.layers, "lr": args.lr, "beta2": args.beta2, "clip": args.clip,
                        "batch": args.batch, "workers": world}}


def framework_config(config, frontend):
    """``(compressor spec, mode)`` of ``config`` for a framework's run: ``none@grad`` (plain DDP)
    or ``COMPRESSOR@auto`` (the framework's one line, AdamW's momentum by its default)."""
    spec, mode, *_ = parse_config(config)
    if (spec, mode) != ("none", "grad") and mode != "auto":
        raise ValueError(f"--frontend {frontend} runs none@grad and COMPRESSOR@auto, not {config!r}")
    return spec, mode


def run_trainer(rank, world, config, seed, args, data):
    """One run through the transformers ``Trainer`` (``--frontend trainer``): its AdamW
    (``adamw_torch``, weight decay ``DECAY``), a linear warm-up over :func:`lr_warmup` then a
    cosine decay to 10 % (``cosine_with_min_lr``), its clipping; ``none@grad`` plain DDP,
    ``COMPRESSOR@auto`` with ``register(trainer, COMPRESSOR)`` (with AdamW ``"auto"`` by default).
    The training windows are drawn from every rank's share of the bytes by the Trainer's
    distributed sampler; evaluated every ``EVAL_EVERY`` updates on the held-out windows."""
    import tempfile

    from transformers import Trainer, TrainingArguments, TrainerCallback
    from transformers.utils import logging as hf_logging

    from mergecomp.torch.integrations.transformers import register

    spec, mode = framework_config(config, "trainer")
    hf_logging.set_verbosity_error()
    train, held_out = data
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    windows = [random_windows(train, gen, 1)[0] for _ in range(args.steps * args.batch * world)]  # the sampler's shards
    curve, began = [], time.perf_counter()

    class Curve(TrainerCallback):
        def on_evaluate(self, targs, state, control, metrics=None, **kwargs):
            curve.append({"step": state.global_step, "test_loss": metrics["eval_loss"],
                          "seconds": time.perf_counter() - began})

    clip = 1.0 if args.clip is None else args.clip  # the Trainer's max_grad_norm default
    torch.manual_seed(seed)
    model = make_model(args.layers, args.model)
    saved = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, as the other front end runs (accelerate sets 2)
    with tempfile.TemporaryDirectory() as folder:
        targs = TrainingArguments(
            output_dir=folder, max_steps=args.steps, per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=len(held_out) // world, learning_rate=args.lr, weight_decay=DECAY,
            adam_beta2=args.beta2, warmup_steps=lr_warmup(args.steps), lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1}, max_grad_norm=clip,
            optim="adamw_torch", eval_strategy="steps", eval_steps=EVAL_EVERY, save_strategy="no",
            logging_strategy="no", report_to="none", use_cpu=True, ddp_backend="gloo",
            ddp_find_unused_parameters=False, seed=seed, data_seed=seed, disable_tqdm=True,
            dataloader_drop_last=True)
        trainer = Trainer(model=model, args=targs, callbacks=[Curve()],
                          train_dataset=[{"input_ids": w, "labels": w} for w in windows],
                          eval_dataset=[{"input_ids": w, "labels": w} for w in held_out])
        callback = register(trainer, spec) if mode == "auto" else None  # AdamW: "auto" by default
        torch.set_num_threads(1)
        trainer.train()
    os.environ.clear()  # the Trainer's accelerate state edits it; the next run needs it back
    os.environ.update(saved)
    return hook_record(config, seed, args, world, "trainer", clip, model, callback.hook_state if callback else None,
                       curve, began)


def hook_record(config, seed, args, world, frontend, clip, model, hook, curve, began):
    """The record of a run through a framework's DDP hook (``hook``: its ``DDPHookState``, None
    for plain DDP) on ``model``, evaluated along ``curve`` since ``began``; ValueError where the
    hook sent AdamW's gradients (``config`` asks for its momentum by the default)."""
    if hook is not None and hook.momentum is None:
        raise ValueError(f"--frontend {frontend}: the hook sent AdamW's gradients (no recipe serves it), not {config}")
    shapes = [p.shape for p in model.parameters()]
    momentum = hook.momentum.exchange if hook else None
    refresh = momentum.refresh_every if momentum else None
    return {"config": config, "seed": seed, "steps": args.steps, "after": momentum.after if momentum else None,
            "compressor": repr(hook.merged.exchange.compressor) if hook else "DDP fp32",
            "parameters": sum(s.numel() for s in shapes),
            "warmup_codec": repr(warmup_compressor(hook.merged)) if hook else None, "refresh": refresh,
            "bits_per_element": bits_over_run(hook.merged, shapes, args.steps, momentum) if hook else 32.0,
            "final_test_loss": StdlibBytes.final_loss(curve), "curve": curve, "wall_s": time.perf_counter() - began,
            "status": "ok",
            "setting": {"frontend": frontend, "model": args.model, "corpus": args.corpus, "layers": args.layers,
                        "lr": args.lr, "beta2": args.beta2, "clip": clip, "batch": args.batch, "workers": world}}


def run_accelerate(rank, world, config, seed, args, data):
    """One run through Accelerate (``--frontend accelerate``): the model and AdamW through
    ``accelerator.prepare`` (DDP over gloo), :func:`run_one`'s windows and LR schedule (on the
    AdamW itself: Accelerate's prepared scheduler would step once per process), its
    ``backward`` and ``clip_grad_norm_``; ``none@grad`` plain DDP, ``COMPRESSOR@auto`` with
    ``register(accelerator, model, COMPRESSOR, optimizer=opt)`` (with AdamW ``"auto"`` by default)."""
    from accelerate import Accelerator

    from mergecomp.torch.integrations.accelerate import register

    spec, mode = framework_config(config, "accelerate")
    train, held_out = data
    torch.manual_seed(seed)
    model = make_model(args.layers, args.model)
    adamw, lr_schedule = scheduled_adamw(model.parameters(), args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, as the other front ends run
    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(1)
    ddp, opt = accelerator.prepare(model, adamw)
    hook = register(accelerator, ddp, spec, optimizer=opt) if mode == "auto" else None
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    curve, began = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        windows = random_windows(train, gen, args.batch)
        opt.zero_grad()
        accelerator.backward(ddp(input_ids=windows, labels=windows).loss)
        if args.clip is not None:
            accelerator.clip_grad_norm_(ddp.parameters(), args.clip)
        opt.step()
        lr_schedule.step()
        evaluate(model, held_out, step, args.steps, curve, began)
    return hook_record(config, seed, args, world, "accelerate", args.clip, model, hook, curve, began)


def run_lightning(rank, world, config, seed, args, data):
    """One run through Lightning (``--frontend lightning``): :func:`run_one`'s model, windows
    (this rank's, Lightning's distributed sampler off), AdamW and LR schedule (per update) in a
    ``LightningModule``, ``Trainer(gradient_clip_val=--clip)``; ``none@grad`` Lightning's
    ``DDPStrategy``, ``COMPRESSOR@auto`` ``MergecompDDPStrategy(COMPRESSOR)`` (with AdamW
    ``"auto"`` by default, the run's length from fit's ``estimated_stepping_batches``)."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from mergecomp.torch.integrations._hook import BUCKET_VIEWS
    from mergecomp.torch.integrations.lightning import MergecompDDPStrategy

    spec, mode = framework_config(config, "lightning")
    train, held_out = data
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    windows = torch.cat([random_windows(train, gen, args.batch) for _ in range(args.steps)])
    curve, began = [], time.perf_counter()
    torch.manual_seed(seed)
    model = make_model(args.layers, args.model)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            return self.model(input_ids=batch, labels=batch).loss

        def on_train_batch_end(self, outputs, batch, index):
            evaluate(self.model, held_out, self.trainer.global_step, args.steps, curve, began)

        def configure_optimizers(self):
            adamw, lr_schedule = scheduled_adamw(self.parameters(), args)
            return {"optimizer": adamw, "lr_scheduler": {"scheduler": lr_schedule, "interval": "step"}}

    strategy = MergecompDDPStrategy(spec) if mode == "auto" else DDPStrategy(**BUCKET_VIEWS)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                        gradient_clip_val=args.clip, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    torch.set_num_threads(1)
    trainer.fit(Module(), torch.utils.data.DataLoader(windows, batch_size=args.batch))
    hook = strategy.hook_state if mode == "auto" else None
    return hook_record(config, seed, args, world, "lightning", args.clip, model, hook, curve, began)


RUNS = {"optimizer": run_one, "trainer": run_trainer, "accelerate": run_accelerate, "lightning": run_lightning}


def worker(rank, world, port, jobs, args, queue):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    import mergecomp.torch as mc

    torch.set_num_threads(1)
    mc.init(engine="torch")
    data = rank_data(rank, world, corpus=args.corpus)
    for config, seed in jobs:
        try:
            record = RUNS[args.frontend](rank, world, config, seed, args, data)
        except Exception as err:  # a failing configuration is a result too
            record = {"config": config, "seed": seed, "status": f"failed: {err}"}
        if rank == 0:
            queue.put(record)
    mc.shutdown()


def report(records, configs, seeds):
    base = {r["seed"]: r["final_test_loss"] for r in records if r["config"] == BASELINE and r["status"] == "ok"}
    setting = next((r["setting"] for r in records if "setting" in r), {})
    print(f"{setting.get('model', 'gpt2')} {setting.get('layers', 4)}x256 on {setting.get('corpus', 'stdlib')} bytes, AdamW (lr {setting.get('lr', LR)}, beta2 "
          f"{setting.get('beta2', 0.999)}, clip {setting.get('clip')}), {setting.get('workers', 2)} workers x batch "
          f"{setting.get('batch', BATCH)} x {CONTEXT} bytes, {records[0].get('steps')} steps, seeds {seeds}: "
          f"medians over seeds, paired with uncompressed AdamW ({BASELINE}) on the same seed\n")
    print("| configuration | warm-up | bits per element (run) | validation loss | vs uncompressed AdamW | within 1 % "
          "| MB beyond AdamW's state |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted({(r["config"], r.get("after")) for r in records if r["status"] == "ok"},
                  key=lambda key: (configs.index(key[0]) if key[0] in configs else len(configs), key[1] or 0))
    for config, after in keys:
        rs = [r for r in records if (r["config"], r.get("after")) == (config, after) and r["status"] == "ok"
              and r["seed"] in seeds]
        if not rs or config not in configs:
            continue
        deltas = [r["final_test_loss"] / base[r["seed"]] - 1 for r in rs if r["seed"] in base]
        delta = statistics.median(deltas) if deltas else None
        shown = "-" if delta is None or config == BASELINE else f"{100 * delta:+.2f} % ({len(deltas)} seeds)"
        within = "-" if delta is None or config == BASELINE else ("yes" if delta <= TARGET else "no")
        print(f"| {config} | {rs[0]['after'] or '-'} | {statistics.median(r['bits_per_element'] for r in rs):.2f} | "
              f"{statistics.median(r['final_test_loss'] for r in rs):.4f} | {shown} | {within} | {beyond(rs[0])} |")


def beyond(record):
    """Error-feedback memory and compressor state, in MB (the group buffers, which gradients
    need in every mode, and Adam's own two buffers left out)."""
    if "state_mb" not in record:
        return "-"
    return f"{record['state_mb']['error_feedback'] + record['state_mb']['compressor']:.1f}"


def main():
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    configs = [BASELINE] + [c for c in args.configs.split(",") if c and c != BASELINE]
    if args.report:
        records = [json.loads(line) for path in args.report.split(",") for line in open(path)]
        return report(records, configs, seeds)
    jobs = [(config, seed) for seed in seeds for config in configs if not (args.no_baseline and config == BASELINE)]
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, args.workers, port, jobs, args, queue), daemon=True)
             for r in range(args.workers)]
    for p in procs:
        p.start()
    records = []
    from mergecomp_bench.records import append, provenance

    made_by = provenance()
    try:
        for config, seed in jobs:
            record = queue.get(timeout=3600)
            records.append(record)
            if args.json:
                append(args.json, record, made_by)
            status = f"{record['final_test_loss']:.4f}" if record["status"] == "ok" else record["status"]
            print(f"# {record['config']} seed {record['seed']}: {status}", file=sys.stderr, flush=True)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    report(records, configs, seeds)


if __name__ == "__main__":
    main()
