"""A synthetic image-text corpus, rendered locally with Pillow, for the ``debug-vl`` demo.

Five tasks, each a small image, a question and a one-word answer:

=======  ==================================  ===============================  ======
task     image                               question                         chance
=======  ==================================  ===============================  ======
digit    one digit 0-9, random size/place    ``what digit is this ?``         1/10
shape    a circle, square or triangle        ``what shape is this ?``         1/3
color    the same shapes, four colours       ``what color is this ?``         1/4
count    1-5 dots                            ``how many dots ?``              1/5
word     one of eight three-letter words     ``what word is this ?``          1/8
=======  ==================================  ===============================  ======

Images are 56 or 84 pixels on each side (4x4 to 6x6 patches of 14, so 4 to 9 tokens after
the 2x2 merge), on a random dark background. Training and held-out examples come from
disjoint seeds. A word-level tokenizer over the corpus's ~50 words (``build_tokenizer``) keeps
the vocabulary inside the ``debug-vl`` preset's 64 ids; ``<|media_pad|>`` is id 3, the preset's
``media_placeholder_token_id``.

A sequence: ``<|bos|> <|media_begin|> <|media_pad|> x N <|media_end|> question answer <|eos|>``;
only the answer and ``<|eos|>`` are predicted (the loss ignores the rest).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont
from tokenizers import Tokenizer, models, pre_tokenizers

from openk3.config import VisionConfig
from openk3.ops.loss import IGNORE_INDEX
from openk3.vision.preprocess import PackedImages, expand_placeholders, pack_images

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|media_pad|>", "<|media_begin|>", "<|media_end|>"]
PAD, BOS, EOS, MEDIA_PAD, MEDIA_BEGIN, MEDIA_END = range(len(SPECIAL))
DIGITS = [str(i) for i in range(10)]
SHAPES = ["circle", "square", "triangle"]
COLORS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240), "yellow": (240, 220, 40)}
WORDS = ["cat", "dog", "sun", "box", "car", "hat", "pen", "cup"]
COUNTS = ["1", "2", "3", "4", "5"]
QUESTIONS = {"digit": "what digit is this ?", "shape": "what shape is this ?",
             "color": "what color is this ?", "count": "how many dots ?",
             "word": "what word is this ?"}
ANSWERS = {"digit": DIGITS, "shape": SHAPES, "color": list(COLORS), "count": COUNTS, "word": WORDS}
TASKS = tuple(QUESTIONS)
SIDES = (56, 84)


def vocabulary() -> list[str]:
    words = SPECIAL + DIGITS + SHAPES + list(COLORS) + WORDS
    for q in QUESTIONS.values():
        words += [w for w in q.split() if w not in words]
    return words


def build_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A word-level tokenizer over ``vocabulary()`` (whitespace-separated); saved to ``path``."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary())}, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    if path is not None:
        tok.save(str(path))
    return tok


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _canvas(rng: random.Random) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    w, h = rng.choice(SIDES), rng.choice(SIDES)
    bg = tuple(rng.randint(0, 60) for _ in range(3))
    img = Image.new("RGB", (w, h), bg)
    return img, ImageDraw.Draw(img)


def _ink(rng: random.Random) -> tuple[int, int, int]:
    return tuple(rng.randint(170, 255) for _ in range(3))


def _shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def render(task: str, rng: random.Random) -> tuple[Image.Image, str]:
    """One (image, answer) of ``task``."""
    img, draw = _canvas(rng)
    W, H = img.size
    answer = rng.choice(ANSWERS[task])
    if task in ("digit", "word"):
        size = rng.randint(24, 32) if task == "digit" else rng.randint(16, 20)
        font = _font(size)
        x0, y0, x1, y1 = draw.textbbox((0, 0), answer, font=font)
        x = rng.randint(0, max(0, W - (x1 - x0))) - x0
        y = rng.randint(0, max(0, H - (y1 - y0))) - y0
        draw.text((x, y), answer, fill=_ink(rng), font=font)
    elif task in ("shape", "color"):
        kind = answer if task == "shape" else rng.choice(SHAPES)
        fill = COLORS[answer] if task == "color" else _ink(rng)
        side = rng.randint(20, min(W, H) - 6)
        x, y = rng.randint(2, W - side - 2), rng.randint(2, H - side - 2)
        _shape(draw, kind, (x, y, x + side, y + side), fill)
    else:  # count: non-overlapping dots on a grid of 12-pixel cells
        cells = [(cx, cy) for cx in range(W // 12) for cy in range(H // 12)]
        r = 4
        for cx, cy in rng.sample(cells, int(answer)):
            x, y = cx * 12 + 6 + rng.randint(-1, 1), cy * 12 + 6 + rng.randint(-1, 1)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=_ink(rng))
    return img, answer


@dataclass
class Example:
    image: Image.Image
    task: str
    answer: str


def examples(n: int, seed: int, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """``n`` examples, tasks in turn, from ``seed`` (training and evaluation use disjoint seeds)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        img, answer = render(task, rng)
        out.append(Example(img, task, answer))
    return out


def prompt_ids(tok: Tokenizer, task: str, tokens: int) -> list[int]:
    """The prompt up to the answer: bos, the image's ``tokens`` placeholders, the question."""
    ids = [BOS, MEDIA_BEGIN, MEDIA_PAD, MEDIA_END] + tok.encode(QUESTIONS[task]).ids
    return expand_placeholders(ids, [tokens], MEDIA_PAD)


def batch(exs: list[Example], tok: Tokenizer, cfg: VisionConfig
          ) -> tuple[torch.Tensor, torch.Tensor, PackedImages]:
    """(input_ids [B, T], labels [B, T] predicting only the answer and eos, packed images);
    sequences right-padded with ``<|pad|>``."""
    images = pack_images([e.image for e in exs], cfg)
    seqs, labels = [], []
    for e, n in zip(exs, images.tokens_per_image(cfg)):
        prompt = prompt_ids(tok, e.task, n)
        target = tok.encode(e.answer).ids + [EOS]
        seq = prompt + target
        seqs.append(seq[:-1])
        labels.append([IGNORE_INDEX] * (len(prompt) - 1) + target)
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD)
    lab = torch.full((len(seqs), T), IGNORE_INDEX)
    for i, (s, t) in enumerate(zip(seqs, labels)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(t)] = torch.tensor(t)
    return ids, lab, images


@torch.no_grad()
def evaluate(model, tok: Tokenizer, exs: list[Example], batch_size: int = 64) -> dict[str, float]:
    """Accuracy per task (and ``"all"``): the answer is the argmax over that task's answer words
    of the next-token logits after the prompt (a closed-set choice, like a classifier)."""
    cfg = model.cfg.vision_config
    device = next(model.parameters()).device
    correct: dict[str, list[int]] = {t: [0, 0] for t in TASKS}
    model.eval()
    # prompts batched by length, so no row reads padding (the model takes no attention mask:
    # left padding changed an example's answer with its batch's other prompts)
    by_length: dict[int, list[tuple[Example, PackedImages, list[int]]]] = {}
    for e in exs:
        packed = pack_images([e.image], cfg)
        prompt = prompt_ids(tok, e.task, packed.tokens_per_image(cfg)[0])
        by_length.setdefault(len(prompt), []).append((e, packed, prompt))
    batches = [group[i:i + batch_size] for group in by_length.values() for i in range(0, len(group), batch_size)]
    for batch in batches:
        chunk = [e for e, _, _ in batch]
        images = PackedImages.cat([p for _, p, _ in batch])
        ids = torch.tensor([prompt for _, _, prompt in batch], device=device)
        logits = model(ids, images=images.to(device), logits_to_keep=1).logits[:, -1].float()
        for e, row in zip(chunk, logits):
            choices = [tok.token_to_id(a) for a in ANSWERS[e.task]]
            pick = ANSWERS[e.task][int(row[choices].argmax())]
            correct[e.task][0] += pick == e.answer
            correct[e.task][1] += 1
    acc = {t: c / n for t, (c, n) in correct.items() if n}
    acc["all"] = sum(c for c, _ in correct.values()) / max(1, sum(n for _, n in correct.values()))
    return acc


def chance(tasks: tuple[str, ...] = TASKS) -> dict[str, float]:
    """The accuracy of guessing uniformly among each task's answers."""
    out = {t: 1 / len(ANSWERS[t]) for t in tasks}
    out["all"] = sum(out.values()) / len(tasks)
    return out
