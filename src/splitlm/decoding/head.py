"""A trained draft head on the edge (EAGLE-style feature extrapolation, with an MLP for a layer).

Every verification pass leaves the edge the final-normed hidden state h_t of each tree node (the
LM head's input, computed on the edge anyway) and, once the step is verified, the next token
x_{t+1} (the bonus token, the root of the next tree). The head predicts the next hidden state,

    ĥ_{t+1} = h_t + W2·silu(W1·[h_t ; e(x_{t+1})])          # [D]

and reads draft tokens off it with the model's own LM head, restricted to the `vocab_ids` the
model emits most (a few thousand of 49k: the draft's LM head costs a fraction of the target's).
Fed its own prediction and each candidate token, it goes on a depth at a time, keeping the top k
per node. Why EAGLE-style and not Medusa's independent heads or Hydra's: predicting features,
conditioned on the token actually chosen, removes the ambiguity that makes Medusa's deeper heads
weak, and one small shared block serves every depth (a few MB); an MLP instead of EAGLE's
transformer layer trains within minutes on a CPU and drafts in a few ms per depth.

Trained by `splitlm train-head` on the model's own greedy answers (`splitlm.decoding.train_head`);
stored as EDGE_DIR/draft_head.safetensors, and a copy per model under
`$SPLITLM_CACHE/heads/MODEL_HASH.safetensors`: the head reads only the final hidden state and the LM
head, so it does not depend on where the model is split, and every later split of the same model
finds it. The bundled model's head ships with the package (`splitlm/data/heads/MODEL_HASH.safetensors`,
its training report beside it), found last: a head the user trained wins (`find_head`). Never sent.
"""

from __future__ import annotations

import copy
import heapq
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from splitlm.decoding.drafters import Drafter, KeyedCalibration, either
from splitlm.decoding.layer_head import LayerHead, LayerHeadShape
from splitlm.decoding.step import StepResult
from splitlm.decoding.tree import TokenTree
from splitlm.model.linear import Linear
from splitlm.result_files import note_head

log = logging.getLogger(__name__)

HEAD_FILE = "draft_head.safetensors"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "heads"  # heads shipped with the package


class DraftHead(nn.Module):
    def __init__(self, hidden: int, inner: int, vocab_ids: torch.Tensor):
        super().__init__()
        self.fc1 = Linear(2 * hidden, inner)
        self.fc2 = Linear(inner, hidden)
        self.fc1.bf16_blocked = self.fc2.bf16_blocked = True  # a few MB: drafting in bf16 is faster blocked
        self.register_buffer("vocab_ids", vocab_ids.long())  # [S] the draft's vocabulary
        self.path: Path | None = None  # the file it was loaded from (`load_head`)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h [B, D] (final-normed hidden state), e [B, D] (embedding of the next token) -> ĥ [B, D]."""
        return h + self.fc2(F.silu(self.fc1(torch.cat([h, e], -1))))


def save_head(head: DraftHead | LayerHead, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write a head's weights (its parameters in `dtype` when given; its buffers as they are)."""
    from safetensors.torch import save_file

    params = {name for name, _ in head.named_parameters()}
    state = {
        k: (v.to(dtype) if dtype is not None and k in params else v).contiguous() for k, v in head.state_dict().items()
    }
    save_file(state, str(path))


def cached_head_path(model_hash: str) -> Path:
    """Where the trained head of a model (any split of it) is kept on this machine."""
    from splitlm.model.loading import cache_root

    return cache_root() / "heads" / f"{model_hash}.safetensors"


def shipped_head_path(model_hash: str) -> Path:
    """Where the package keeps the MLP head it ships for a model (the bundled one's): any split."""
    return SHIPPED_DIR / f"{model_hash}.safetensors"


def shipped_layer_head_path(model_hash: str) -> Path:
    """Where the package keeps the head that reads the edge's layers, for one split of a model."""
    return SHIPPED_DIR / f"{model_hash}.layers.safetensors"


def head_report_path(head_path: str | Path) -> Path:
    """The training report kept next to a head: `X.safetensors` -> `X.json`."""
    return Path(head_path).with_suffix(".json")


def head_paths(edge_dir: str | Path, model_hash: str | None = None) -> list[Path]:
    """The heads an edge may draft with, in order: the shard's own (`train-head --edge`), the one trained
    for its model on this machine (the cache), the ones shipped with the package for its model (the one
    that reads the edge's layers, for the split it was trained on, then the MLP, for any). Every one is
    keyed by the model's weights (`model_hash`), so a head is never used with another model."""
    paths = [Path(edge_dir) / HEAD_FILE]
    if model_hash:
        paths += [cached_head_path(model_hash), shipped_layer_head_path(model_hash), shipped_head_path(model_hash)]
    return [p for p in paths if p.is_file()]


def find_head(edge_dir: str | Path, model_hash: str | None = None) -> Path | None:
    """The first of `head_paths`, or None."""
    found = head_paths(edge_dir, model_hash)
    return found[0] if found else None


def head_origin(path: Path) -> str:
    """Where a head found by `find_head` comes from, in words (the demo says it)."""
    if path.parent.resolve() == SHIPPED_DIR:
        return "shipped with splitlm for this model"
    if path.name == HEAD_FILE:
        return "the edge shard's own (splitlm train-head --edge)"
    return "trained for this model on this machine (splitlm train-head)"


def read_head(path: str | Path) -> DraftHead | LayerHead:
    """A head file: the MLP over the final state (`DraftHead`) or the one that reads the edge's layers."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    if "fuse.weight" in state:
        shape = LayerHeadShape.from_tensor(state["dims"], state["rope_theta"], state["norm_eps"])
        head = LayerHead(shape, state["vocab_ids"], tuple(state["layers"].tolist()))
    else:
        head = DraftHead(state["fc2.weight"].shape[0], state["fc2.weight"].shape[1], state["vocab_ids"])
    head.load_state_dict(state)
    head.path = Path(path)  # where it came from: the result files record it
    return head.eval()


def load_head(
    edge_dir: str | Path, model_hash: str | None = None, layers: tuple[int, int] | None = None
) -> DraftHead | LayerHead | None:
    """The trained draft head for this edge shard (the first of `head_paths` that fits it), or None. A head
    that reads the edge's layers fits only a split with the same K and L − M (`layers`; None: any). The
    run's result files name it (`note_head`)."""
    head = fitting_head(edge_dir, model_hash, layers)
    if head is not None:
        note_head(head.path)
    return head


def fitting_head(
    edge_dir: str | Path, model_hash: str | None = None, layers: tuple[int, int] | None = None
) -> DraftHead | LayerHead | None:
    """`load_head`'s head, not noted as used."""
    for path in head_paths(edge_dir, model_hash):
        head = read_head(path)
        if isinstance(head, LayerHead) and layers is not None and not head.fits(*layers):
            log.info(
                "draft head %s reads layers %s, this edge's split is %s: not used", path, head.feature_layers, layers
            )
            continue
        return head
    return None


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 products are native on `device` (CUDA; CPUs with AVX-512 BF16). A fixed rule, not
    a timing: the same machine always drafts the same trees."""
    if device.type == "cuda":
        return True
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return device.type == "cpu" and probe is not None and bool(probe())


class HeadRunner:
    """A head with the edge's embedding and LM-head rows of its vocabulary, ready to draft.

    Drafts need not be exact (the cloud verifies them), so where bf16 products are native
    (`native_bf16`) the head and its LM-head rows run in bf16, as it was trained: half the bytes of
    the 8k-row head to read at every depth (2.1 -> 1.0 ms per depth for 6 rows on this CPU)."""

    def __init__(
        self,
        head: DraftHead,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        embed_scale: float = 1.0,
        dtype: torch.dtype | None = None,
    ):
        w = lm_head.detach().float()[head.vocab_ids]  # [S, D]
        if dtype is None:
            dtype = torch.bfloat16 if native_bf16(w.device) else torch.float32
        self.dtype = dtype
        self.head = copy.deepcopy(head).to(dtype)  # the caller's head stays as it was
        self.embed, self.scale = embed.detach(), embed_scale  # [V, D]
        self.lm = Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=dtype).requires_grad_(False)
        self.lm.bf16_blocked = True
        with torch.no_grad():
            self.lm.weight.copy_(w)  # [S, D]
        self.ids = head.vocab_ids
        self.calibration = KeyedCalibration()

    def drafter(self) -> HeadDrafter:
        return HeadDrafter(self)

    @torch.inference_mode()
    def step(self, h: torch.Tensor, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [B, D], next tokens [B] -> (ĥ [B, D], top-k probabilities [B, k], their token ids [B, k])."""
        e = (self.embed[torch.tensor(tokens)].float() * self.scale).to(self.dtype)
        nh = self.head(h.to(self.dtype), e)
        logits = self.lm(nh).float()  # [B, S]
        top = logits.topk(k, -1).indices  # [B, k]
        # softmax, not exp(top - logsumexp): logsumexp's exp of a wide logit range was 3x slower here
        probs = torch.softmax(logits, -1).gather(-1, top)  # [B, k]
        return nh, probs, self.ids[top]

    @torch.inference_mode()
    def advance(self, h: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """h [B, D], next tokens [B] -> ĥ [B, D] (no LM head: nothing is drafted)."""
        e = (self.embed[torch.tensor(tokens)].float() * self.scale).to(self.dtype)
        return self.head(h.to(self.dtype), e)

    def roll(self, h: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """h [D] before known `tokens` -> ĥ [D] at the last of them."""
        h = h[None]
        for tok in tokens:
            h = self.advance(h, [tok])
        return h[0]


MAX_ROLL = 32  # known tokens the head rolls through before it drafts (a longer chain: no drafts)
AFTER_NODES = 16  # nodes `propose_after` drafts in all


class HeadDrafter(Drafter):
    """Best-first tree from the head: expand the likeliest paths, `width` at a depth, top `k` each,
    until no path is left with a chance of `min_reach` to be accepted that far.

    With a `guide` (the other drafters' merged tree, in `auto`), a path's chance counts their
    votes too (1 − Π(1 − p) per node, as `auto` merges them), so the head spends its depths where
    the merged tree is strong and confirms the other drafters' chains."""

    name = "head"
    extras = 1  # the hidden states (and the top-1 it comes with)
    guided = True
    drafts_after = True

    def __init__(
        self,
        runner: HeadRunner,
        max_depth: int = 8,
        k: int = 4,
        width: int = 6,
        max_nodes: int = 64,
        min_reach: float = 0.01,
    ):
        self.runner, self.max_depth, self.k, self.width, self.max_nodes = runner, max_depth, k, width, max_nodes
        self.min_reach = min_reach
        self.hidden: torch.Tensor | None = None  # [D] of the node before the anchor (the last bonus token)
        self.last: TokenTree | None = None
        self.owed = 0  # tokens of the last pass still to come by `extend` (its accepted ones and the anchor)
        self.known: list[int] = []  # tokens the context gained after the anchor (a grammar's forced chain)
        self.fresh = True  # reset, no pass verified since

    def reset(self, context: list[int]) -> None:
        super().reset(context)
        self.hidden, self.owed, self.known, self.fresh = None, 0, [], True

    def extend(self, tokens: list[int]) -> None:
        super().extend(tokens)
        paid = min(self.owed, len(tokens))
        self.owed -= paid
        self.known += tokens[paid:]

    def rolled(self) -> torch.Tensor | None:
        """The hidden state before the root (context[-1]): the last pass's, rolled through the tokens
        the context gained after the anchor; None when there is none to draft from."""
        if self.hidden is None or len(self.known) > MAX_ROLL:
            return None
        return self.runner.roll(self.hidden, self.context[-len(self.known) - 1 : -1]) if self.known else self.hidden

    def propose(self, guide: TokenTree | None = None) -> TokenTree:
        tree = TokenTree.root_only(self.context[-1])
        self.last = tree
        hidden = self.rolled()
        if hidden is not None:
            # (reach, node, hidden state before the node's token, the node in the guide or None)
            self.grow(tree, [(1.0, 0, hidden, 0 if guide is not None else None)], guide, self.max_nodes)
        return tree

    def propose_after(self, paths: list[list[int]], reaches: list[float], guide: TokenTree | None = None) -> TokenTree:
        """A tree holding `paths` (token paths after the root that the step may carry, each reached with
        the chance in `reaches`) and the head's drafts after each of them."""
        tree = TokenTree.root_only(self.context[-1])
        hidden = self.rolled()
        if hidden is None or not paths:
            return tree
        nodes = [[0] for _ in paths]  # each path's nodes, root first
        for path, ns in zip(paths, nodes, strict=True):
            for tok in path:
                ns.append(tree.add(ns[-1], tok, 1.0))
        # the hidden state before each path node's token, a depth at a time (shared prefixes once)
        before = {0: hidden}
        for depth in range(1, max(map(len, paths)) + 1):
            todo = sorted({ns[depth] for ns in nodes if len(ns) > depth and ns[depth] not in before})
            if todo:
                parents = [tree.parents[n] for n in todo]
                hs = self.runner.advance(torch.stack([before[q] for q in parents]), [tree.tokens[q] for q in parents])
                before.update(zip(todo, hs, strict=True))
        frontier = [(reach, ns[-1], before[ns[-1]], None) for ns, reach in zip(nodes, reaches, strict=True)]
        self.grow(tree, frontier, None, len(tree) + AFTER_NODES)
        return tree

    def grow(self, tree: TokenTree, frontier: list, guide: TokenTree | None, max_nodes: int) -> None:
        """Best-first: from `frontier` [(reach, node, hidden state before its token, guide node)] add
        the top `k` of the likeliest `width` nodes a depth at a time, up to `max_nodes`."""
        cal = self.runner.calibration
        for depth in range(1, self.max_depth + 1):
            if not frontier or len(tree) >= max_nodes:
                break
            hs = torch.stack([h for _, _, h, _ in frontier])
            nh, probs, ids = self.runner.step(hs, [tree.tokens[n] for _, n, _, _ in frontier], self.k)
            grown = []
            for (reach, node, _, g), h, ps, ts in zip(frontier, nh, probs.tolist(), ids.tolist(), strict=True):
                for rank, (p, t) in enumerate(zip(ps, ts, strict=True)):
                    if len(tree) >= max_nodes:
                        break
                    key = (min(depth, 5), rank, min(9, int(p * 10)))
                    q = cal.p(key, p)
                    child = tree.add(node, t, q, key)
                    gc = guide.child(g, t) if g is not None else None
                    merged = q if gc is None else either(q, guide.scores[gc])
                    grown.append((reach * merged, child, h, gc))
            frontier = [x for x in heapq.nlargest(self.width, grown, key=lambda x: x[0]) if x[0] >= self.min_reach]

    def verified(self, tree: TokenTree, path: list[int], new: list[int], step: StepResult) -> None:
        hidden = step.hidden
        self.hidden = None if hidden is None else hidden[path[-1]].float()
        # after the prefill the context already holds the first token; after a pass, `new` is to come
        self.owed, self.known = (0 if self.fresh else len(new)), []
        self.fresh = False
        if self.last is not None and len(self.last) > 1:
            self.runner.calibration.learn(self.last, new)
        self.last = None
