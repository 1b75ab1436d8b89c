"""Chat template (ChatML-like) with the stop word ``<|im_end|>``.

``render(messages, add_generation_prompt=True)`` is the prompt a request
sends; the model's answer ends with the stop word. After the response, the
conversation including the assistant turn is rendered without the generation
prompt and right-stripped (as XTuner's session server does), so its text is
exactly the old prompt, plus the response text, plus the stop word: the key of
the response node in the trace store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .tokenizer import IM_END, IM_START

STOP_WORD = IM_END
GENERATION_PROMPT = f"{IM_START}assistant\n"

Message = Mapping[str, str]


def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``) to the prompt text."""
    out: list[str] = []
    for m in messages:
        out.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        out.append(GENERATION_PROMPT)
    return "".join(out)


def render_after_response(messages: Sequence[Message], assistant: Message) -> str:
    """The conversation with the assistant turn, no generation prompt, right-stripped."""
    return render([*messages, assistant], add_generation_prompt=False).rstrip()


def strip_stop(text: str) -> tuple[str, bool]:
    """``(content, stopped)``: the text before the stop word, and whether it was present."""
    cut = text.find(STOP_WORD)
    if cut < 0:
        return text, False
    return text[:cut], True
