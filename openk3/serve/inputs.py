"""A request's input checks: prompt to token ids, images placed and packed, every limit.

``RequestInputs`` needs only the tokenizer, the model's config, the engine's config and the
context length the cache allows: no model, no cache, no engine state. So the checks run where
the request arrives: in ``LLMEngine.add_request``, on the HTTP server's event loop before a
stream starts (``AsyncEngine``), and in the server's process while the engine runs in its own
(``openk3.serve.engine_process``). A bad request raises ``InvalidRequest`` naming the parameter
at fault before anything is queued.
"""

from __future__ import annotations

import struct
from array import array
from typing import NamedTuple

import torch

from openk3.config import ModelConfig
from openk3.serve.config import EngineConfig
from openk3.serve.multimodal import ImageLike, MultiModalInput, open_image, place_images, special_token_id
from openk3.serve.sampler import InvalidRequest, SamplingParams
from openk3.vision.preprocess import pack_images


# Up to this many ids a prompt's range is checked by Python's min and max over its array (~3 us
# for 128 ids, where torch's frombuffer and aminmax cost ~25 us whatever the length); longer
# prompts by torch (32K ids: ~0.03 ms, Python's min and max 1 ms).
SMALL_PROMPT = 512


class Checked(NamedTuple):
    """A prompt ``RequestInputs.checked`` accepted: its token ids and the same ids as an int64
    ``array`` (what prefill passes upload). ``StreamingEngine.generate`` takes it as the prompt
    without checking the ids again (servers check before a stream starts)."""

    ids: list[int]
    packed: array


def utf8_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode text; a lone surrogate (valid JSON: ``"\\ud800"``) is
    an ``InvalidRequest`` naming ``param`` (tokenizers raised on it, or replaced it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(param, f"is not valid Unicode text ({e.reason} at character {e.start})") from None
    return text


class RequestInputs:
    """``speculative``: the engine runs a draft (images are refused then)."""

    def __init__(self, tokenizer, model_config: ModelConfig, config: EngineConfig, max_model_len: int,
                 speculative: bool = False):
        self.tokenizer, self.model_config, self.config = tokenizer, model_config, config
        self.max_model_len, self.speculative = max_model_len, speculative

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(utf8_text(prompt, "prompt"))
        if isinstance(prompt, (bytes, bytearray, dict, set)) or not hasattr(prompt, "__iter__"):
            raise InvalidRequest("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    @property
    def vision_config(self):
        """The model's vision config; ``InvalidRequest`` (``images``) if it has no tower."""
        if self.model_config.vision_config is None:
            raise InvalidRequest("images", "this model has no vision tower (its config has no vision_config)")
        return self.model_config.vision_config

    def prepare_images(self, prompt: str | list[int], images: list[ImageLike]) -> tuple[list[int], MultiModalInput]:
        """The prompt's token ids with its images' placeholders (``multimodal.place_images``: one
        placeholder per image in the prompt, expanded where it is, or none, the images first) and
        the images, decoded and packed. Raises ``InvalidRequest`` naming ``images[k]`` or the
        prompt."""
        vcfg = self.vision_config
        if self.speculative:
            raise InvalidRequest("images", "images with speculative decoding are not supported")
        if isinstance(images, (str, bytes)) or not images:
            raise InvalidRequest("images", "must be a non-empty list of images")
        try:
            pics = [open_image(im, f"images[{k}]", self.config.max_image_bytes) for k, im in enumerate(images)]
            packed = pack_images(pics, vcfg)
        except ValueError as e:
            raise InvalidRequest("images", str(e)) from e
        if isinstance(prompt, str) and not prompt:
            prompt = []
        try:
            ids, spans = place_images(self.tokenize(prompt), packed, [p.size for p in pics],
                                      packed.tokens_per_image(vcfg), vcfg.media_placeholder_token_id,
                                      self.tokenizer.encode, lambda name: special_token_id(self.tokenizer, name),
                                      self.model_config.bos_token_id)
        except ValueError as e:
            raise InvalidRequest("prompt", str(e)) from e
        return ids, MultiModalInput(packed, spans)

    def validate(self, prompt: str | list[int], params: SamplingParams,
                 images: MultiModalInput | None = None) -> list[int]:
        """Token ids of ``prompt``; raises ``InvalidRequest`` naming the parameter at fault.
        With ``images`` (``prepare_images``) the prompt must be the ids it returned."""
        return self.checked(prompt, params, images)[0]

    def checked(self, prompt: str | list[int], params: SamplingParams,
                images: MultiModalInput | None) -> Checked:
        """``validate``, and the ids as an int64 ``array`` (what prefill passes upload)."""
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequest("prompt", "is empty")
        ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequest("prompt", "is empty")
        bad = InvalidRequest("prompt", f"token ids must be integers in [0, {vocab})")
        # C loops, 32K ids in ~0.4 ms: their int64 bytes by struct (a float, string or None
        # raises, as does an int beyond int64; integer types such as numpy's convert: 0.3 ms,
        # where array("q", ids) took 0.6) and their range (min and max of the list: 1.3 ms).
        # Bools convert too, to 0 and 1: only the positions holding those values are looked at
        # (a scan of every id's type was another 0.75 ms)
        try:
            packed = array("q", struct.pack(f"{len(ids)}q", *ids))
        except struct.error:
            raise bad from None
        if len(packed) <= SMALL_PROMPT:
            lo, hi = min(packed), max(packed)
            low = [i for i, v in enumerate(packed) if v <= 1] if lo <= 1 else []
        else:
            values = torch.frombuffer(packed, dtype=torch.long)
            lo, hi = values.aminmax()
            low = (values <= 1).nonzero()[:, 0].tolist() if lo <= 1 else []
        if lo < 0 or hi >= vocab or any(type(ids[i]) is bool for i in low):
            raise bad
        if images is not None:
            pad = self.vision_config.media_placeholder_token_id
            if (ids.count(pad) != sum(s.length for s in images.spans)
                    or any(ids[s.offset:s.offset + s.length] != [pad] * s.length for s in images.spans)):
                raise InvalidRequest("prompt", f"the image placeholders (id {pad}) do not match the "
                                               "images (use LLMEngine.prepare_images)")
        self.check_params(len(ids), params)
        return Checked(ids, packed)

    def check_params(self, num_ids: int, params: SamplingParams) -> None:
        """The checks of ``params`` against a prompt of ``num_ids`` ids (``checked`` runs them;
        ``StreamingEngine.generate`` again for each choice of a ``Checked`` prompt)."""
        if params.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequest("max_tokens", f"{params.max_tokens} exceeds the limit "
                                               f"{self.config.max_tokens_limit}")
        if num_ids >= self.max_model_len:
            raise InvalidRequest("prompt", f"{num_ids} tokens do not fit the context of "
                                           f"{self.max_model_len} tokens (one is needed to generate)")
        if num_ids + params.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", f"prompt ({num_ids} tokens) + max_tokens "
                                               f"({params.max_tokens}) exceeds the context of "
                                               f"{self.max_model_len} tokens")
