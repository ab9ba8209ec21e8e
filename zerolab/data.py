"""A small built-in corpus and a character-level tokenizer, for `python -m zerolab.train`.

The text is public domain (the openings of Lewis Carroll's *Alice's Adventures in Wonderland*,
1865, and Jane Austen's *Pride and Prejudice*, 1813, and Lincoln's Gettysburg Address, 1863):
a few kilobytes, enough for a tiny GPT to learn letter and word statistics in a few dozen steps,
with no download.

    corpus = Corpus.builtin()
    x, y = corpus.batch(batch_size=8, block_size=64, seed=step)   # (8, 64) token ids each
    corpus.tokenizer.decode(x[0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALICE = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having \
nothing to do: once or twice she had peeped into the book her sister was reading, but it had \
no pictures or conversations in it, 'and what is the use of a book,' thought Alice 'without \
pictures or conversations?'

So she was considering in her own mind (as well as she could, for the hot day made her feel \
very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the \
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran \
close by her.

There was nothing so very remarkable in that; nor did Alice think it so very much out of the \
way to hear the Rabbit say to itself, 'Oh dear! Oh dear! I shall be late!' (when she thought it \
over afterwards, it occurred to her that she ought to have wondered at this, but at the time it \
all seemed quite natural); but when the Rabbit actually took a watch out of its \
waistcoat-pocket, and looked at it, and then hurried on, Alice started to her feet, for it \
flashed across her mind that she had never before seen a rabbit with either a \
waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across the \
field after it, and fortunately was just in time to see it pop down a large rabbit-hole under \
the hedge.

In another moment down went Alice after it, never once considering how in the world she was \
to get out again.

The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly down, so \
suddenly that Alice had not a moment to think about stopping herself before she found herself \
falling down a very deep well.
"""

AUSTEN = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a \
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he \
is considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is \
let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.
"""

LINCOLN = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- \
this ground. The brave men, living and dead, who struggled here, have consecrated it, far \
above our poor power to add or detract. The world will little note, nor long remember what we \
say here, but it can never forget what they did here.
"""

BUILTIN_TEXT = "\n".join([ALICE, AUSTEN, LINCOLN])


@dataclass(frozen=True)
class CharTokenizer:
    """One token per distinct character of the text it was built from, in sorted order."""

    chars: str  # the vocabulary: token i is chars[i]

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """(len(text),) int64 token ids. Raises KeyError on a character outside the vocabulary."""
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass(frozen=True)
class Corpus:
    """A tokenized text to draw training windows from."""

    tokens: torch.Tensor  # (n,) int64 token ids
    tokenizer: CharTokenizer  # how they map to characters

    @classmethod
    def builtin(cls) -> Corpus:
        return cls.from_text(BUILTIN_TEXT)

    @classmethod
    def from_text(cls, text: str) -> Corpus:
        tokenizer = CharTokenizer.from_text(text)
        return cls(tokenizer.encode(text), tokenizer)

    def batch(self, batch_size: int, block_size: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` random windows: inputs (batch, block) and next-token targets, same shape.

        The same seed gives the same batch in every process, so ranks can draw one global batch
        and each take its own rows.
        """
        if len(self.tokens) <= block_size:
            raise ValueError(f"block_size={block_size} needs a text longer than "
                             f"{len(self.tokens)} tokens")
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(self.tokens) - block_size, (batch_size,), generator=gen)
        rows = torch.stack([self.tokens[s:s + block_size + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]
