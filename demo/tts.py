"""``tiny-tts``: a tiny random-weight 3-speaker VITS, built offline from a seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random-weight 3-speaker VITS (16 kHz, character vocabulary) to ``out_dir``."""
    from transformers import VitsConfig, VitsModel, VitsTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chars = ["<pad>", " ", *"abcdefghijklmnopqrstuvwxyz'0123456789", "<unk>"]
    vocab_file = out_dir / "vocab.json"
    vocab_file.write_text(json.dumps({c: i for i, c in enumerate(chars)}))
    tokenizer = VitsTokenizer(vocab_file=str(vocab_file), phonemize=False, normalize=True, add_blank=True)
    voices = ["amy", "ben", "cleo"]
    torch.manual_seed(seed)
    config = VitsConfig(
        vocab_size=len(chars),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        flow_size=16,
        spectrogram_bins=16,
        num_speakers=len(voices),
        speaker_embedding_size=8,
        upsample_initial_channel=32,
        upsample_rates=(8, 4, 4),  # 128 samples per spectrogram frame
        upsample_kernel_sizes=(16, 8, 8),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1, 3),),
        use_stochastic_duration_prediction=False,
        duration_predictor_filter_channels=16,
        prior_encoder_num_flows=2,
        prior_encoder_num_wavenet_layers=1,
        posterior_encoder_num_wavenet_layers=1,
        sampling_rate=16_000,
        pad_token_id=0,
    )
    model = VitsModel(config)
    with torch.no_grad():  # random durations run to minutes; speak 4 frames (32 ms) per token instead
        model.duration_predictor.proj.weight.zero_()
        model.duration_predictor.proj.bias.fill_(math.log(4.0))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "voices.json").write_text(json.dumps(voices))
    return out_dir
