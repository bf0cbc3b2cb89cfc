"""``tiny-moderation``: a 2-layer random-weight BERT sequence classifier over OpenAI's moderation
categories (multi-label, one sigmoid each), with tiny-embed's offline WordPiece tokenizer, built
from a seed."""

from __future__ import annotations

from pathlib import Path

import torch

from demo.embed import tiny_bert

# OpenAI's omni-moderation categories, in the order its answers list them
CATEGORIES = ["harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
              "self-harm", "self-harm/instructions", "self-harm/intent", "sexual", "sexual/minors", "violence",
              "violence/graphic"]


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Save ``tiny-moderation`` to ``out_dir``: classifier (``save_pretrained``) and tokenizer."""
    model, _ = tiny_bert(Path(out_dir), seed, id2label=dict(enumerate(CATEGORIES)),
                         label2id={c: i for i, c in enumerate(CATEGORIES)}, problem_type="multi_label_classification")
    with torch.no_grad():  # spread the scores: some categories flagged at 0.5, some not, on any text
        model.classifier.weight.normal_(0.0, 1.0)
        model.classifier.bias.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    return out_dir
