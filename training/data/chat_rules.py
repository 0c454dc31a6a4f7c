"""Chat data as MiniMind's SFTDataset / DPODataset prepare it, as options: the empty think block and system prompts.

MiniMind's chat template writes an empty `<think>\\n\\n</think>\\n\\n` before an assistant reply that has no reasoning;
its datasets remove it from 80% of the rendered conversations (`post_processing_chat`, SFT and both DPO sides) and
put a system prompt drawn from a list before 20% of the SFT conversations that have none (`pre_processing_chat`);
`data.think` and `data.system_prompts` choose (the schema says how). MiniMind draws anew each time a sample is read;
here each row's draws are fixed by (`data.seed`, the row's number, the DPO side), so the cached tokens, every layout
and a resumed run see the same samples, and the shares hold over the data set.
"""

import random
from dataclasses import dataclass
from typing import Any

EMPTY_THINK = "<think>\n\n</think>\n\n"
MINIMIND_THINK_KEPT = 0.2  # post_processing_chat(empty_think_ratio=0.2): the block stays in 20% of conversations


class Conversation(list):
    """A conversation's messages with what to do to its rendered text: drop the empty think block or not."""

    drop_think: bool = False
    open_thinking: bool = False  # the template's `open_thinking` variable (MiniMind's switch)


def finish(conversation: Any, text: str) -> str:
    """The rendered text of `conversation` after its think rule."""
    return text.replace(EMPTY_THINK, "") if getattr(conversation, "drop_think", False) else text


@dataclass(frozen=True)
class ChatRules:
    """How chat rows are prepared before tokenising (the data section's think and system-prompt keys)."""

    think: str
    system_prompts: tuple[str, ...]
    system_ratio: float
    seed: int
    open_thinking: bool = False  # data.open_thinking, handed to the chat template of every conversation

    @property
    def active(self) -> bool:
        return self.think != "keep" or bool(self.system_prompts) or self.open_thinking

    def identity(self) -> dict[str, Any]:
        """What the token cache's key adds (nothing for the defaults, so existing caches keep their keys)."""
        if not self.active:
            return {}
        return {"think": self.think, "system_prompts": list(self.system_prompts), "system_ratio": self.system_ratio,
                "rules_seed": self.seed, **({"open_thinking": True} if self.open_thinking else {})}

    def _draw(self, row: int, side: int, what: str) -> random.Random:
        return random.Random(f"{self.seed}:{row}:{side}:{what}")  # str seeds hash stably (sha512)

    def conversation(self, row: int, turns: list[dict[str, Any]], side: int = 0, system: bool = True) -> Conversation:
        """One conversation of row `row` (`side` 1: a DPO pair's rejected one) with its system prompt and think rule."""
        out = Conversation(turns)
        out.open_thinking = self.open_thinking
        if system and self.system_prompts and (not turns or turns[0].get("role") != "system"):
            draw = self._draw(row, side, "system")
            if draw.random() < self.system_ratio:
                out.insert(0, {"role": "system", "content": draw.choice(self.system_prompts)})
        if self.think == "drop":
            out.drop_think = True
        elif self.think == "minimind":
            out.drop_think = self._draw(row, side, "think").random() > MINIMIND_THINK_KEPT
        return out

    def prepare(self, row: int, payload: Any) -> Any:
        """A row's payload prepared: a conversation, or a DPO pair's two (MiniMind adds no system prompt to pairs)."""
        if isinstance(payload, tuple):
            return tuple(self.conversation(row, turns, side, system=False) for side, turns in enumerate(payload))
        return self.conversation(row, payload)
