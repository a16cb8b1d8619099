"""Self-speculation by early exit: the target drafts with its own first L layers.

Draft & Verify (Zhang et al. 2309.08168) and LayerSkip (Elhoushi et al. 2404.16710): a draft
token is the target's final norm and output head applied to the hidden state after layer L
instead of after the last layer. No second model, no second vocabulary, no second cache.

One KV cache, shared. Between steps the target's cache holds every token of the context but the
last, in every layer (the engine keeps it so). A proposal, for every drafting row at once:

    1. runs [last] and each draft token but the final one through layers 0 .. L-1 only:
       forward_rows(..., n_layers=L) writes their K/V into the rows' next slots of those layers
       (the deeper layers' slots are left as they were);
    2. rolls the rows back to len(context) - 1 tokens, so that the target's verification pass
       over [last, *draft] starts at the same slot and rewrites every layer there. Layers < L get
       the same K/V back (same tokens, same positions; only float rounding of a different batch
       shape can differ), layers >= L get theirs for the first time;
    3. the engine's rollback to len(context) + n_accepted then leaves all layers holding exactly
       the accepted tokens: the drafter's view of the cache is the target's, by construction.

So `accept` has nothing to do. With `width` w > 1 the draft is a tree as a draft model's is
(drafters.model.Levels): beside each chain token the exit's next w - 1 candidates of the same
distribution, free for the drafter (the chain's forwards give them), scored by the target's
verification in the same forward (forward_tree_rows); with `nodes`, the most probable paths.

The target's forward_rows must take n_layers: the NumPy backend's
(its forward stops after a layer) and the torch backend's (its decoder runs with its first layers
only, models/transformers.py). llama.cpp's C API runs a model's layers whole, so there is no early
exit on it (an early-exit head drafts there as a draft model of its own: below).

LayerSkip goes further and starts verification at layer L from the draft's own hidden states. We
recompute the first L layers instead: the verification pass is then exactly a plain forward, so
the output cannot depend on what the drafter did, and the code stays simple.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..errors import SpecdecError
from ..sampling import SamplingParams
from .base import Declared, Draft, fit_tree, tree_shape
from .model import Levels


class EarlyExitDrafter(Declared):
    """Rows are the target's own (the engine's row ids are the target's). With `blocks`, the
    trained blocks the target has attached after its first n_layers layers (an early-exit head on
    the torch backend: exit_head_drafter) run between them and the final norm. `width` and `nodes`:
    a tree's shape, as a draft model's (drafters.model)."""

    takes = frozenset({"widths"})  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(
        self,
        model,
        n_layers: int,
        blocks: int = 0,
        prior: Sequence[float] | None = None,
        width: int = 1,
        nodes: int = 0,
    ):
        if not model.exits_early:
            raise SpecdecError(
                "early-exit drafting needs a target on the NumPy or torch backend (its forward can stop "
                "after the first layers; llama.cpp's runs every layer)"
            )
        if not 1 <= n_layers <= model.n_layer:
            raise SpecdecError(f"early exit after {n_layers} layers: pick 1..{model.n_layer} for {model.name}")
        self.model = model  # the target itself: drafter and target share its cache
        self.n_layers = n_layers
        self.blocks = blocks
        self.width, self.nodes = width, nodes
        self.name = f"early-exit:{n_layers}" + (f"+{blocks}" if blocks else "") + tree_shape(width, nodes)
        self.kind = "early-exit"
        self.prior = prior  # P(position i kept | the ones before were): a head file's held-out agreement
        self._exit = {"n_layers": n_layers, **({"blocks": True} if blocks else {})}
        self._rows: dict[int, tuple[SamplingParams, np.random.Generator]] = {}

    def lag(self, row: int, context: Sequence[int]) -> int:
        """What auto asks of a draft model: nothing to catch up on (the target's cache is the draft's)."""
        return 0

    def cost_curve(self, repeats: int = 5) -> dict[int, float]:
        """auto's price of one draft position over w rows: the exit's forward of w tokens (one row
        stands for w: a forward's cost is its tokens'), timed here on a scratch row of the target
        after 16 tokens, the median of `repeats`, the row given back after."""
        import time

        model = self.model
        row = model.add_rows(1)[0]
        try:
            model.forward_rows({row: [0] * 16})
            curve = {}
            for w in (1, 2, 4, 8, 16, 32):
                seconds = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    model.forward_rows({row: [0] * w}, {row: 1}, **self._exit)
                    seconds.append(time.perf_counter() - t)
                    model.rollback_rows({row: 16})
                curve[w] = float(np.median(seconds))
            return curve
        finally:
            model.drop_rows([row])

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._rows[row] = (params, rng)

    def end(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)

    def propose(
        self,
        contexts: Mapping[int, Sequence[int]],
        ks: Mapping[int, int],
        widths: Mapping[int, int] | None = None,
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, Draft]:
        """Each row's draft of ks[row] tokens: a tree of widths[row] (default: the drafter's width;
        `auto` chooses one per row and step), of at most leaves[row] leaves (0: a chain)."""
        model = self.model
        ks = {row: min(k, model.n_ctx - len(contexts[row])) for row, k in ks.items()}
        drafts = {row: Draft([]) for row, k in ks.items() if k <= 0}
        ks = {row: k for row, k in ks.items() if k > 0}
        if not ks:
            return drafts
        verified = {row: len(contexts[row]) - 1 for row in ks}  # tokens the cache should hold in every layer
        over = {row: n for row, n in verified.items() if model.row_length(row) > n}
        if over:
            model.rollback_rows(over)
        behind = {row: contexts[row][model.row_length(row) : n] for row, n in verified.items()}
        behind = {row: tokens for row, tokens in behind.items() if tokens}
        if behind:  # not the engine's target (or not in step): catch up through every layer
            model.forward_rows(behind)
        # each row's shape within its leaves, before anything is drawn (drafters.base.fit_tree)
        levels = {
            row: Levels(*fit_tree((widths or {}).get(row, self.width), self.nodes, k, (leaves or {}).get(row)))
            for row, k in ks.items()
        }
        depth = dict(ks)
        last = {row: contexts[row][-1] for row in ks}
        for i in range(max(ks.values())):
            feed = {row: [last[row]] for row in ks if i < depth[row]}
            if not feed:
                break
            # 1. the first n_layers layers, then the final norm and head
            logits = model.forward_rows(feed, {row: 1 for row in feed}, **self._exit)
            for row in feed:
                last[row] = levels[row].add(logits[row][0], *self._rows[row])
                if levels[row].settled():
                    depth[row] = i + 1  # no deeper node could be chosen: the chain ends here
        # 2. hand the cache back as we found it: verification rewrites these slots in every layer
        model.rollback_rows(verified)
        return {**drafts, **{row: levels[row].draft() for row in ks}}

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        # 3. nothing to do: the engine's rollback of the target row already cut the shared cache
        pass


# --------------------------------------------------------------------------------------------
# Early exit with trained blocks (`specdec train early-exit:L+B`): a draft model built once
# --------------------------------------------------------------------------------------------


def exit_head_drafter(target, head_path, width: int = 1, nodes: int = 0) -> EarlyExitDrafter:
    """An early-exit head drafting through the torch target's own cache: its B blocks
    (exit_blocks) attached after the target's first L layers (TransformersModel.attach_exit_blocks).
    `width` and `nodes`: a tree's shape."""
    from . import headfile
    from .head import held_out_prior

    info = headfile.read_info(head_path)
    target.attach_exit_blocks(info.layers, exit_blocks(target, head_path))
    return EarlyExitDrafter(target, info.layers, info.blocks, held_out_prior(info), width, nodes)


def exit_blocks(target, head_path) -> list:
    """An early-exit head's B blocks as decoder layers of the torch target's own class (copies of
    its layers L .. L + B - 1, given the head's weights). The weights come from a GGUF of the
    target's metadata and the blocks alone (exit_model_path(blocks_only=True)), read by
    transformers' GGUF reader, which knows each architecture's tensor names and Q/K layout; the
    same Q8_0-rounded weights the head's draft model has, without loading that model (its first L
    layers, embedding and tokenizer: as long again as the target's own load)."""
    import copy

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from ..models.transformers import quiet_transformers
    from . import headfile

    info = headfile.read_info(head_path)
    path = exit_model_path(target, head_path, blocks_only=True)
    with quiet_transformers():
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=target.model)["tensors"]
    layers = list(target._decoder_layers())
    blocks = []
    for i in range(info.layers, info.layers + info.blocks):
        block = copy.deepcopy(layers[i])
        own = {name.split(f".layers.{i}.", 1)[1]: t for name, t in tensors.items() if f".layers.{i}." in name}
        missing = sorted(set(block.state_dict()) - set(own))
        if missing:
            raise SpecdecError(f"{head_path}: block {i} lacks {', '.join(missing)} as transformers reads it")
        block.load_state_dict(own)
        blocks.append(block)
    return blocks


def exit_model_path(target, head_path, blocks_only: bool = False) -> Path:
    """The GGUF that drafts for an early-exit head file: the target's metadata (its block count
    now L + B), its embedding, final norm and output head, its first L layers as they are (the
    same quantisation), and the head's B blocks (Q8_0 matrices, float32 norms and biases). Built
    once under $SPECDEC_HOME/exits, named by the target's and the head's sha256, written whole.
    `blocks_only`: the target's metadata as it is and the blocks alone (exit_blocks reads them)."""
    from ..models.base import file_sha256
    from ..paths import specdec_home
    from . import headfile

    info = headfile.read_info(head_path)
    headfile.check_target(info, target, head_path)
    source = getattr(target, "path", None)
    if info.kind != "early-exit":
        raise SpecdecError(f"{head_path} is a {info.kind} head, not an early exit")
    if source is None or Path(source).suffix != ".gguf":
        raise SpecdecError(
            "an early-exit head drafts as a draft model built from the target's GGUF file: load the target "
            "from its .gguf (not a transformers folder)"
        )
    name = f"{info.target_sha256[:16]}-{file_sha256(Path(head_path))[:16]}" + ("-blocks" if blocks_only else "")
    out = specdec_home() / "exits" / f"{name}.gguf"
    if not out.exists():  # (the blocks are read only to build it)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_exit_gguf(Path(source), info, headfile.load(head_path)[1], out, blocks_only)
    return out


def write_exit_gguf(source, info, tensors: dict, out, blocks_only: bool = False) -> None:
    """exit_model_path's GGUF, written to a temporary name and moved into place."""
    import os

    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    layers = info.layers + info.blocks
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            if blocks_only and field.name.startswith("tokenizer."):
                continue  # (its 150k-entry arrays would be parsed for nothing)
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if field.name == f"{arch}.block_count" and not blocks_only:
                value = layers
            elif field.name == "general.name":
                value = f"{value} early exit {info.layers}+{info.blocks}"
            writer.add_key_value(field.name, value, kind, sub_type=sub)
        for t in [] if blocks_only else reader.tensors:
            if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= info.layers:
                continue  # the target's deeper layers: not in the draft
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        for name, w in sorted(tensors.items(), key=lambda kv: _layer_order(kv[0])):
            w = np.asarray(w, np.float32)
            if w.ndim == 2 and w.shape[1] % 32 == 0:
                writer.add_tensor(
                    name,
                    gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                    raw_dtype=gguf.GGMLQuantizationType.Q8_0,
                )
            else:
                writer.add_tensor(name, w)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def _layer_order(name: str) -> tuple[int, str]:
    return int(name.split(".")[1]), name
