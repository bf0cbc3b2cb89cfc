"""LoRA fine-tuning of a chat model: the trainer worker (``kind: train``) that fine-tuning jobs
(``tuning.runner``) run on, placed and evicted by the arbiter like any model, always at the batch tier.

It holds its own copy of the base model's weights (frozen; a chat engine serves the other copy, and
may be vLLM), and for one job at a time a peft LoRA on every linear layer of the decoder with an
AdamW optimizer over the LoRA factors alone. ``train`` runs the job's epochs in a worker thread;
each optimizer step is a step boundary (``StepContext.boundary``): there the job stops if it was
cancelled, and waits while batch work must yield. While it waits the arbiter may move the weights
to host memory (the optimizer's moments move with them) or free them; then the LoRA factors and
the optimizer's state are kept on the host (``unload``) and put back when the model is placed again
(``load``), so the job goes on from the step it reached. A step and a move never overlap (one lock).
At each epoch's end, and where a stop ends the training (a pause, a shutdown), the LoRA factors
and the optimizer's state are also written to a file (``TrainRun.resume``): a job whose process
stopped goes on from that step (after a crash: from its last finished epoch), to the very weights
it would have reached without the stop (the data order is seeded per epoch, and there is no
dropout).

An example's loss is on its assistant turns only (OpenAI's rule; an assistant message with
``"weight": 0`` is left out too): the conversation is rendered once by the model's chat template,
and each assistant turn's span in that text is the difference between the rendering up to it
with the generation prompt and the rendering through it; the tokens whose characters fall in a
span are the labels (a fast tokenizer's offsets). A template that does not render a conversation
turn by turn (an earlier turn drawn differently once later ones follow) is refused by name.

With ``TrainRun.beta`` the examples are preference ``Pair``s and the loss is DPO's (``_dpo``): both
answers of each pair in one batch through the model with its LoRA, each scored by its answer's
summed log-probabilities, against the same scores under the model the job started from (the base,
or the fine-tuned model of ``TrainRun.start``), read once before the first step (``_reference``:
no second copy of the weights, no second pass per step). A job with ``TrainRun.start`` begins its
LoRA from that model's rather than from zero.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from workers.base import Cancelled, ModelSpec, StepContext
from workers.chat import folder_context_length
from workers.worker import ModelInfo, ThreadWorker

IGNORE = -100  # a label the loss skips


class TemplateNotTurnByTurn(ValueError):
    """The chat template renders an earlier turn differently once later turns follow."""


@dataclass(frozen=True)
class Example:
    ids: list[int]
    labels: list[int]  # IGNORE where the loss does not look

    @property
    def trained(self) -> int:
        return sum(label != IGNORE for label in self.labels)

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Pair:
    """A DPO example: the same conversation with the answer to prefer and the one to prefer less,
    each labelled on its answer alone."""

    preferred: Example
    non_preferred: Example

    @property
    def trained(self) -> int:
        return min(self.preferred.trained, self.non_preferred.trained)

    @property
    def tokens(self) -> int:
        return self.preferred.tokens + self.non_preferred.tokens


@dataclass
class TrainRun:
    """One job's training, as the runner hands it over; ``save(step, folder_writer)`` is where
    the worker writes a checkpoint (the runner publishes it)."""

    examples: list[Example] | list[Pair]
    validation: list[Example] | list[Pair]
    n_epochs: int
    batch_size: int
    learning_rate: float
    seed: int
    rank: int
    alpha: int
    out: Path  # checkpoints are written under it, one folder per epoch: step-<N>
    resume: Path | None = None  # the state at the last epoch's end: written at each, read at the start
    beta: float | None = None  # DPO's (the examples are Pairs); None: supervised
    start: Path | None = None  # a fine-tuned model's adapter folder the LoRA starts from (None: zero)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.examples) / self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.n_epochs * self.steps_per_epoch


@dataclass
class _Live:
    """The job under way: its peft model and optimizer, or (while the weights are away) their state."""

    run: TrainRun
    peft: Any = None
    optimizer: torch.optim.Optimizer | None = None
    kept: dict[str, Any] = field(default_factory=dict)  # "lora", "optimizer": host copies while unloaded
    references: list[tuple[float, float]] = field(default_factory=list)  # DPO: each pair's answers at the start
    checks: list[tuple[float, float]] = field(default_factory=list)  # the same, of the validation pairs


class TrainerGone(RuntimeError):
    """The trainer's weights were freed while a job ran, other than for a pause (an admin unload)."""


class StartMismatch(ValueError):
    """The fine-tuned model a job starts from has another rank or alpha than fine-tuning's now."""


class StartGone(ValueError):
    """The fine-tuned model a job starts from was deleted before the trainer read it."""


class LoraTrainer(ThreadWorker):
    """A chat model's weights for LoRA fine-tuning (see the module's docstring)."""

    kind = "train"

    def __init__(self, spec: ModelSpec, training_bytes: int = 0) -> None:
        self.spec = spec
        self.training_bytes = training_bytes  # counted in its footprint (the arbiter's estimate), not used here
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self.device = torch.device("cpu")
        self._live: _Live | None = None
        self._lock = threading.Lock()  # one optimizer step, or one move of the weights, at a time

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(context_length=folder_context_length(spec.path))

    # -- residency -------------------------------------------------------------------------
    def load(self, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with self._lock:
            self.device = device
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
            self.tokenizer = AutoTokenizer.from_pretrained(self.spec.path)
            self.model = AutoModelForCausalLM.from_pretrained(self.spec.path, dtype=dtype).to(device)
            self.model.requires_grad_(False)
            if self._live is not None and self._live.kept:  # a job paused while the weights were away
                self._attach(self._live)

    def unload(self) -> None:
        with self._lock:
            live = self._live
            if live is not None and live.peft is not None:
                live.kept = {"lora": {n: p.detach().to("cpu", copy=True) for n, p in _trainable(live.peft)},
                             "optimizer": _to(live.optimizer.state_dict(), torch.device("cpu"))}
                live.peft = live.optimizer = None
            self.model = None

    def modules(self) -> list[torch.nn.Module]:
        return [self.model] if self.model is not None else []

    def _move(self, device: torch.device, pin: bool) -> None:
        with self._lock:
            super()._move(device, pin)
            live = self._live
            if live is not None and live.optimizer is not None:  # Adam's moments go where their factors go
                for state in live.optimizer.state.values():
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and key != "step":
                            state[key] = value.to(device)

    # -- training --------------------------------------------------------------------------
    def encode(self, messages: list[dict], tools: list[dict] | None, max_len: int) -> Example:
        """(any thread, once loaded) ``messages`` as token ids with labels on the assistant turns."""
        return encode_example(self.tokenizer, messages, tools, max_len)

    def train(self, run: TrainRun, ctx: StepContext, report: Callable[[dict], None]) -> int:
        """(thread) Run ``run``'s epochs; after each step ``report({"step", "train_loss",
        "train_mean_token_accuracy", "tokens"})`` and after each epoch ``report({"checkpoint": path,
        "step", "valid_loss", "valid_mean_token_accuracy"})`` once its adapter is written to
        ``run.out/step-<N>``. With a ``run.resume`` file from an earlier start, it goes on from the
        step that file holds, having first reported ``{"resumed": step, "valid": {step: (loss,
        accuracy) or None}}``; the file is written at each epoch's end and where a stop (a pause,
        a shutdown) ends the training. Returns the tokens trained on by this call. ``Cancelled``
        at a boundary."""
        saved = _read_resume(run.resume)
        initial = None if saved or run.start is None else _start_state(run)  # a fine-tuned model's LoRA
        with self._lock:
            if self.model is None:
                raise TrainerGone("the trainer's weights are not loaded")
            self._live = _Live(run, kept={"lora": saved["lora"], "optimizer": saved["optimizer"]} if saved else {})
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(run.seed)  # the LoRA factors' initial values; the process's generator is left as it was
                self._attach(self._live)
            if initial is not None:
                from peft import set_peft_model_state_dict

                set_peft_model_state_dict(self._live.peft, initial)
            if run.beta is not None:  # DPO's reference: the model as the job starts, base or fine-tuned
                if saved:
                    self._live.references, self._live.checks = saved["references"], saved["checks"]
                else:
                    self._live.references = self._reference(run.examples)
                    self._live.checks = self._reference(run.validation)
        trained, step, first, scores = 0, 0, 0, {}
        if saved:
            step, first, scores = saved["step"], saved["epochs"], dict(saved["valid"])
            report({"resumed": step, "valid": dict(scores)})
        epoch = first
        try:
            for epoch in range(first, run.n_epochs):
                order = torch.randperm(len(run.examples), generator=torch.Generator().manual_seed(run.seed + epoch))
                done = step - epoch * run.steps_per_epoch  # of this epoch's steps: all but the first's are 0
                for start in range(done * run.batch_size, len(order), run.batch_size):
                    ctx.boundary()  # cancelled: Cancelled; batch work must yield: waits here (weights may move)
                    picked = order[start:start + run.batch_size].tolist()
                    batch = [run.examples[i] for i in picked]
                    with self._lock:
                        loss, accuracy = self._step(batch, picked)
                    step += 1
                    trained += sum(e.tokens for e in batch)
                    report({"step": step, "train_loss": loss, "train_mean_token_accuracy": accuracy, "tokens": trained})
                ctx.boundary()
                with self._lock:
                    valid = scores[step] = self._evaluate(run.validation) if run.validation else None
                    folder = run.out / f"step-{step}"
                    self._live.peft.save_pretrained(folder)
                    _name_targets_by_suffix(folder)
                    if run.resume is not None:
                        _write_resume(run.resume, self._live, step, epoch + 1, scores)
                report({"checkpoint": folder, "step": step, "valid_loss": valid and valid[0],
                        "valid_mean_token_accuracy": valid and valid[1]})
            return trained
        except Cancelled:  # stopped between steps: the next start goes on from this one
            if run.resume is not None:
                with self._lock:
                    _write_resume(run.resume, self._live, step, epoch, scores)
            raise
        finally:
            with self._lock:
                self._detach()

    def _attach(self, live: _Live) -> None:
        """(lock held) Put ``live``'s LoRA on the model: new (seeded), or as it was kept."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=live.run.rank, lora_alpha=live.run.alpha, lora_dropout=0.0, target_modules="all-linear",
                            bias="none", task_type="CAUSAL_LM")
        live.peft = get_peft_model(self.model, config)
        if live.kept:
            params = dict(_trainable(live.peft))
            with torch.no_grad():
                for name, value in live.kept["lora"].items():
                    params[name].copy_(value)
        live.optimizer = torch.optim.AdamW([p for _, p in _trainable(live.peft)], lr=live.run.learning_rate,
                                           weight_decay=0.0)
        if live.kept:
            live.optimizer.load_state_dict(live.kept["optimizer"])  # onto the factors' device
        live.kept = {}

    def _detach(self) -> None:
        """(lock held) Take the job's LoRA off the model (the base weights were never changed)."""
        live, self._live = self._live, None
        if live is not None and live.peft is not None and self.model is not None:
            self.model = live.peft.unload()

    def _step(self, batch: list[Example] | list[Pair], picked: list[int]) -> tuple[float, float]:
        """(lock held) One optimizer step over ``batch``: (loss, accuracy): the mean token accuracy,
        or for DPO the share of pairs whose preferred answer the tuned model now favours more than
        the base does."""
        live = self._live
        if live is None or live.peft is None:
            raise TrainerGone("the trainer's weights were freed while the job ran")
        live.peft.train()
        if live.run.beta is not None:
            loss, accuracy = self._dpo(batch, [live.references[i] for i in picked], live.run.beta)
        else:
            ids, mask, labels = _pad(batch, self._pad_id(), self.device)
            out = live.peft(input_ids=ids, attention_mask=mask, labels=labels)
            loss, accuracy = out.loss, _accuracy(out.logits.detach(), labels)
        loss.backward()
        live.optimizer.step()
        live.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), accuracy

    def _dpo(self, pairs: list[Pair], references: list[tuple[float, float]], beta: float) -> tuple[torch.Tensor, float]:
        """(lock held) DPO's loss over ``pairs`` (Rafailov et al. 2023, eq. 7): the mean of
        -log sigmoid(beta * ((log pi(preferred) - log ref(preferred)) - (log pi(non) - log ref(non)))),
        each log-probability the sum over the answer's tokens; ``references`` are each pair's
        under the model the job started from (``_reference``). And the share of pairs whose margin
        is above 0."""
        n = len(pairs)
        policy = self._answers(pairs)
        reference = torch.tensor(references, dtype=policy.dtype, device=policy.device)  # (n, 2)
        margin = beta * ((policy[:n] - reference[:, 0]) - (policy[n:] - reference[:, 1]))
        return -torch.nn.functional.logsigmoid(margin).mean(), float((margin.detach() > 0).float().mean())

    def _answers(self, pairs: list[Pair]) -> torch.Tensor:
        """(lock held) The preferred answers' summed log-probabilities, then the others', in one batch."""
        ids, mask, labels = _pad([p.preferred for p in pairs] + [p.non_preferred for p in pairs], self._pad_id(),
                                 self.device)
        return _answer_logps(self._live.peft(input_ids=ids, attention_mask=mask).logits, labels)

    @torch.no_grad()
    def _reference(self, pairs: list[Pair]) -> list[tuple[float, float]]:
        """(lock held) Each pair's answers' summed log-probabilities under the model now (the
        job's start: the base, whose LoRA is zero, or the fine-tuned model it goes on from): DPO's
        reference, read once rather than at every step (as TRL's ``precompute_ref_log_probs``)."""
        self._live.peft.eval()
        out = []
        for pair in pairs:
            logps = self._answers([pair])
            out.append((float(logps[0]), float(logps[1])))
        return out

    @torch.no_grad()
    def _evaluate(self, examples: list[Example] | list[Pair]) -> tuple[float, float]:
        """(lock held) The loss and accuracy over ``examples``: every labelled token's (the mean
        token accuracy), or for DPO each pair's (the share it favours)."""
        peft = self._live.peft
        peft.eval()
        if self._live.run.beta is not None:
            scores = [self._dpo([pair], [ref], self._live.run.beta) for pair, ref in zip(examples, self._live.checks)]
            return sum(float(loss) for loss, _ in scores) / len(scores), sum(a for _, a in scores) / len(scores)
        loss_sum, right, counted = 0.0, 0, 0
        for example in examples:
            ids, mask, labels = _pad([example], self._pad_id(), self.device)
            logits, wanted = peft(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), labels[:, 1:]
            scored = wanted != IGNORE
            loss_sum += float(torch.nn.functional.cross_entropy(logits[scored], wanted[scored], reduction="sum"))
            right += int((logits.argmax(-1)[scored] == wanted[scored]).sum())
            counted += int(scored.sum())
        return loss_sum / max(counted, 1), right / max(counted, 1)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)


def encode_example(tokenizer: Any, messages: list[dict], tools: list[dict] | None, max_len: int) -> Example:
    """See the module's docstring. ``messages`` may carry OpenAI's ``weight`` on assistant turns."""
    clean = [{k: v for k, v in m.items() if k != "weight"} for m in messages]

    def text(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(clean[:upto], tools=tools or None, add_generation_prompt=prompt,
                                             tokenize=False)

    whole = text(len(clean), False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or message.get("weight", 1) == 0:
            continue
        before, through = text(i, True), text(i + 1, False)
        if not (through.startswith(before) and whole.startswith(through)):
            raise TemplateNotTurnByTurn("the model's chat template does not render a conversation turn by turn, so "
                                        "the assistant's turns cannot be told apart for training")
        spans.append((len(before), len(through)))
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])[:max_len]
    labels = [tok if any(a <= start < b for a, b in spans) else IGNORE
              for tok, (start, _) in zip(ids, encoded["offset_mapping"])]
    return Example(ids, labels)


def _write_resume(path: Path, live: _Live, step: int, epochs: int, scores: dict) -> None:
    """(lock held) The job's state after ``step`` steps, ``epochs`` of its epochs checkpointed,
    written beside and renamed into place: a file is whole or absent. The LoRA and the optimizer's
    state as they are on the model, or as ``unload`` kept them while the weights are away."""
    if live.peft is not None:
        lora = {n: p.detach().to("cpu", copy=True) for n, p in _trainable(live.peft)}
        optimizer = _to(live.optimizer.state_dict(), torch.device("cpu"))
    else:
        lora, optimizer = live.kept["lora"], live.kept["optimizer"]
    state = {"step": step, "epochs": epochs, "valid": scores, "lora": lora, "optimizer": optimizer,
             "references": live.references, "checks": live.checks}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    partial.replace(path)


def _start_state(run: TrainRun) -> dict[str, torch.Tensor]:
    """The LoRA of the fine-tuned model ``run.start`` (peft's saved keys), checked to have the
    rank and alpha the job trains with; ``StartMismatch`` otherwise, ``StartGone`` when it was
    deleted (only a job's first start reads it: a later one goes on from its ``run.resume``)."""
    from safetensors.torch import load_file

    try:  # a DELETE /v1/models renames the folder away at any moment, even between these two reads
        config = json.loads((run.start / "adapter_config.json").read_text())
        if (config.get("r"), config.get("lora_alpha")) != (run.rank, run.alpha):
            raise StartMismatch(f"the model this job goes on from has LoRA rank {config.get('r')} and alpha "
                                f"{config.get('lora_alpha')}; fine-tuning here now trains rank {run.rank}, "
                                f"alpha {run.alpha}")
        return load_file(run.start / "adapter_model.safetensors")
    except FileNotFoundError:
        raise StartGone("the model this job goes on from was deleted") from None


def _read_resume(path: Path | None) -> dict | None:
    """The state ``_write_resume`` left, or None (none, or not readable: the job starts over)."""
    if path is None or not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a file cut short or from another version: start from the first step
        return None


def _name_targets_by_suffix(folder: Path) -> None:
    """The saved adapter's ``target_modules`` as the layers' own names (``q_proj``, ...), as adapters
    are usually shared, rather than every module's full path that "all-linear" leaves there."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    targets = config.get("target_modules")
    if isinstance(targets, list):
        config["target_modules"] = sorted({name.rsplit(".", 1)[-1] for name in targets})
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _to(state: Any, device: torch.device) -> Any:
    """``state`` (an optimizer's state dict) with its tensors copied to ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device, copy=True)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to(v, device) for v in state]
    return state


def _pad(batch: list[Example], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (IGNORE on the padding)."""
    width = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for row, e in enumerate(batch):
        ids[row, :len(e.ids)] = torch.tensor(e.ids)
        mask[row, :len(e.ids)] = 1
        labels[row, :len(e.labels)] = torch.tensor(e.labels)
    return ids.to(device), mask.to(device), labels.to(device)


def _answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens (labels shift by one, as the loss's do)."""
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    wanted = labels[:, 1:]
    scored = wanted != IGNORE
    picked = logps.gather(-1, wanted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * scored).sum(-1)


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Of the labelled places, the share whose next token the model ranked first (labels shift by
    one, as the loss's do)."""
    predicted, wanted = logits[:, :-1].argmax(-1), labels[:, 1:]
    counted = wanted != IGNORE
    return float((predicted[counted] == wanted[counted]).float().mean()) if counted.any() else 0.0
