"""Audio in and out for the speech and transcription workers: decoding uploads, resampling,
time-stretching, encoding speech (whole or streamed), telephone audio (G.711, streamed both ways)
and subtitle formatting.

Everything here is float32 mono numpy in [-1, 1] plus a sample rate; files go through soundfile
(libsndfile), so which compressed formats exist depends on the installed libsndfile and is probed
once at import. An upload libsndfile cannot read (WebM, MP4/M4A, AAC: what browsers and phones
record) is decoded by FFmpeg through PyAV, the containers OpenAI lists only.
"""

from __future__ import annotations

import ctypes
import io
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from fractions import Fraction
from typing import Protocol

import numpy as np
import soundfile as sf

_FLOAT_P = ctypes.POINTER(ctypes.c_float)

# scipy.signal is imported where it is used: ~0.8 s at start that a server without audio skips

# OpenAI response_format -> (libsndfile format, subtype, sample rates it accepts or None for any).
_SOUNDFILE_FORMATS: dict[str, tuple[str, str, tuple[int, ...] | None]] = {
    "wav": ("WAV", "PCM_16", None),
    "flac": ("FLAC", "PCM_16", None),
    "mp3": ("MP3", "MPEG_LAYER_III", (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)),
    "opus": ("OGG", "OPUS", (8000, 12000, 16000, 24000, 48000)),
}

CONTENT_TYPES: dict[str, str] = {
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "pcm": "audio/pcm",
}
_AAC_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)

# An upload's sample rate is taken from its header, which says what its maker likes: every real
# recording lies between a few kHz (telephone 8 kHz, old 4-6 kHz dictation) and DXD's 352.8 kHz or
# 384 kHz; a rate outside is refused before a sample is read (a 244-byte WAV claiming 2**31-1 Hz
# was a 320 GiB filter in ``resample``, one of 4,000,037 Hz 30 s and GBs for its 100 samples)
MIN_UPLOAD_RATE, MAX_UPLOAD_RATE = 1_000, 384_000
# ``resample``'s filter has 20 x max(up, down) taps: an odd rate's exact ratio (16000/4000037) is
# approximated by one with terms at most this large, so its cost follows the samples, not the rate
_MAX_PHASES = 8192
# What an upload may decode to, in float32 samples (1 GiB): 30 minutes of 48 kHz stereo or of 96 kHz fit; a file of a
# higher rate or more channels may be as much shorter (a 384 kHz recording 11 minutes) rather than take GBs to decode
MAX_DECODED_SAMPLES = 2**28


def _probe(fmt: str) -> bool:
    """Whether this libsndfile can write ``fmt`` (tried on a few ms of silence)."""
    container, subtype, rates = _SOUNDFILE_FORMATS[fmt]
    try:
        sf.write(io.BytesIO(), np.zeros(480, np.float32), (rates or (48000,))[-1], format=container, subtype=subtype)
    except Exception:  # noqa: BLE001 - any failure means the format is unavailable
        return False
    return True


_AVAILABLE = [f for f in _SOUNDFILE_FORMATS if _probe(f)] + ["aac", "pcm"]  # aac: FFmpeg's encoder (PyAV)


def supported_speech_formats() -> list[str]:
    """Speech output formats this installation can encode (always wav, flac, aac and pcm)."""
    return list(_AVAILABLE)


# FFmpeg's demuxers (``container.format.name``) for the uploads OpenAI takes that libsndfile does not
# read: webm, mp4, m4a (and mpeg, mpga, aac); anything else FFmpeg finds is refused, not decoded
_AV_CONTAINERS = ("matroska,webm", "mov,mp4,m4a,3gp,3g2,mj2", "aac", "mp3", "mpeg", "ogg", "wav", "flac")


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode an uploaded file to float32 mono: wav, flac, ogg (and mp3 where libsndfile has it)
    through libsndfile; webm, mp4, m4a and aac (and what libsndfile turned down) through FFmpeg.

    Stereo and multi-channel audio is mixed down. Both decode at most ``max_seconds`` plus a
    second (a small FLAC or WebM file of a long silence is not decoded whole: the caller sees it is
    too long). Raises ``ValueError`` for bytes that are not audio, are corrupt, hold no samples, or
    whose header says a rate outside ``MIN_UPLOAD_RATE``..``MAX_UPLOAD_RATE`` (checked before any
    sample is decoded).
    """
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sr = _checked_rate(f.samplerate)
            frames = f.frames if max_seconds is None else min(f.frames, int((max_seconds + 1) * sr))
            _checked_size(frames * f.channels, sr, f.channels)
            x = f.read(frames, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        why = getattr(e, "error_string", None) or str(e)  # libsndfile's own words, not "Error opening <BytesIO at 0x...>"
        mono, sr = _decode_with_ffmpeg(data, max_seconds, why)
    else:
        mono = x.mean(axis=1, dtype=np.float32)
    if len(mono) == 0:
        raise ValueError("the audio file holds no samples")
    return mono, int(sr)


def _decode_with_ffmpeg(data: bytes, max_seconds: float | None, why: str) -> tuple[np.ndarray, int]:
    """The first audio stream of ``data`` through PyAV, mixed down to mono float32 at its own rate;
    ``why`` is libsndfile's reason, said when FFmpeg cannot read it either."""
    import av

    expected = "expected wav, flac, ogg, mp3, webm, mp4, m4a or aac"
    chunks: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if container.format.name not in _AV_CONTAINERS:
                raise ValueError(f"could not decode audio ({expected}): a {container.format.long_name} file")
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise ValueError(f"could not decode audio ({expected}): the file holds no audio stream")
            codec = stream.codec_context  # None: a codec this FFmpeg has no decoder for (or a damaged header)
            rate = codec.sample_rate if codec is not None else 0
            if not rate:
                raise ValueError(f"could not decode audio ({expected}): its audio stream has no codec or sample rate "
                                 "FFmpeg can read")
            _checked_rate(rate)
            mono = av.AudioResampler(format="flt", layout="mono", rate=rate)
            cap = None if max_seconds is None else int((max_seconds + 1) * rate)
            got = 0
            for frame in container.decode(stream):
                for out in mono.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    got += chunks[-1].size
                    _checked_size(got, rate, 1)
                if cap is not None and got > cap:
                    break
            else:
                chunks += [out.to_ndarray().reshape(-1) for out in mono.resample(None)]
    except av.FFmpegError as e:
        raise ValueError(f"could not decode audio ({expected}): {why}; FFmpeg: {e.strerror or e}") from None
    x = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    return x, rate


def _checked_size(samples: int, rate: int, channels: int) -> None:
    """``ValueError`` when an upload decodes to more than ``MAX_DECODED_SAMPLES`` (mono after
    FFmpeg's mix-down, every channel through libsndfile, which reads them before the mix)."""
    if samples > MAX_DECODED_SAMPLES:
        raise ValueError(f"the audio is too long for its sample rate ({rate} Hz, {channels} channel(s)): this server "
                         f"decodes at most {MAX_DECODED_SAMPLES // (rate * channels)} s of it")


def _checked_rate(rate: int) -> int:
    """``rate``, read from an upload's header; ``ValueError`` outside the rates real audio has."""
    if not MIN_UPLOAD_RATE <= rate <= MAX_UPLOAD_RATE:
        raise ValueError(f"the audio's header says a sample rate of {rate} Hz; this server takes "
                         f"{MIN_UPLOAD_RATE} to {MAX_UPLOAD_RATE} Hz")
    return rate


def resample(x: np.ndarray, sr_from: int, sr_to: int) -> np.ndarray:
    """Resample float32 mono audio with a polyphase filter. The ratio of two common rates is exact
    (44.1 kHz to 16 kHz: 160/441); that of an odd rate is approximated (``_MAX_PHASES``), its
    length then off by less than one part in 8192."""
    if sr_from == sr_to:
        return x.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    ratio = Fraction(sr_to, sr_from)
    if max(ratio.numerator, ratio.denominator) > _MAX_PHASES:  # bound the larger term: down, or up
        ratio = ratio.limit_denominator(_MAX_PHASES) if ratio < 1 else 1 / (1 / ratio).limit_denominator(_MAX_PHASES)
    return resample_poly(x, ratio.numerator, ratio.denominator).astype(np.float32)


G711_CODECS = {"pcmu": "pcm_mulaw", "pcma": "pcm_alaw"}  # G.711 mu-law and A-law: telephone audio
G711_RATE = 8000


class G711Stream:
    """Telephone audio streamed to or from 16-bit PCM at ``rate``: G.711 mu-law (``"pcmu"``) or
    A-law (``"pcma"``) at 8 kHz, a byte a sample. ``encode`` False: G.711 bytes in, PCM16 bytes out;
    True: the other way. FFmpeg's codec and resampler, through PyAV; the resampler keeps its
    filter's state from one piece to the next, so pieces as short as a phone network's 20 ms frames
    join without seams (it holds back a few milliseconds, which ``flush`` returns)."""

    def __init__(self, law: str, rate: int, encode: bool) -> None:
        import av

        self._av, self.encode = av, encode
        self._codec = av.CodecContext.create(G711_CODECS[law], "w" if encode else "r")
        self._codec.sample_rate, self._codec.layout = G711_RATE, "mono"
        if encode:
            self._codec.format = "s16"
        self._rate = rate
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=G711_RATE if encode else rate)

    def feed(self, data: bytes) -> bytes:
        """The next piece: G.711 bytes (to decode) or PCM16 bytes, little-endian (to encode)."""
        if not data:
            return b""
        if not self.encode:
            return b"".join(self._pcm(self._resampler.resample(f)) for f in self._codec.decode(self._av.Packet(data)))
        frame = self._av.AudioFrame.from_ndarray(np.frombuffer(data, "<i2").astype(np.int16)[None, :], format="s16",
                                                 layout="mono")
        frame.sample_rate = self._rate
        return self._g711(self._resampler.resample(frame))

    def flush(self) -> bytes:
        """What the resampler held back: the stream's end."""
        frames = self._resampler.resample(None)
        return self._g711(frames) if self.encode else self._pcm(frames)

    def _g711(self, frames: list) -> bytes:
        return b"".join(bytes(packet) for frame in frames for packet in self._codec.encode(frame))

    @staticmethod
    def _pcm(frames: list) -> bytes:
        return b"".join(frame.to_ndarray().reshape(-1).astype("<i2").tobytes() for frame in frames)


class NoiseReducer:
    """Background noise taken out of streamed speech: RNNoise (Xiph's recurrent network for noise
    suppression in speech, through the ``pyrnnoise`` wheel, which carries the library with its
    weights) on 10 ms frames at 48 kHz. The stream's ``rate`` must divide 48 kHz (24 kHz in a
    realtime session; 8 and 16 kHz too); it goes up and back down by that factor through a
    windowed-sinc low-pass (scipy's ``firwin``; the samples it still needs from the last piece
    kept), so nothing is held back but the part of a frame still waiting to be whole, and pieces
    of any size give the same stream as one piece.

    ``feed`` takes int16 samples at ``rate`` and returns as many: the denoised stream, ``delay``
    samples (10 ms) later, which is a frame's wait; the speech in it is 31 ms later than in the
    input, with RNNoise's own 20 ms and the two filters' half millisecond each."""

    RATE = 48_000  # RNNoise's
    TAPS = 49  # the low-pass's length at 48 kHz: 24 samples (0.5 ms) of delay each way

    def __init__(self, rate: int) -> None:
        from pyrnnoise import rnnoise
        from scipy.signal import firwin

        if self.RATE % rate:
            raise ValueError(f"noise reduction runs at rates that divide {self.RATE} Hz, not {rate}")
        self._lib, self._state, self._frame = rnnoise.lib, rnnoise.create(), rnnoise.FRAME_SIZE
        self.rate, self._factor = rate, self.RATE // rate
        self._lowpass = firwin(self.TAPS, 1 / self._factor) if self._factor > 1 else None
        if self._lowpass is not None:  # the up phases, each as long as the first (zeros after), gain ``factor``
            width = -(-self.TAPS // self._factor)
            self._phases = [np.pad(self._lowpass[p::self._factor], (0, width - len(self._lowpass[p::self._factor])))
                            * self._factor for p in range(self._factor)]
            self._up_history, self._down_history = np.zeros(width - 1), np.zeros(self.TAPS - 1)
        self.delay = self._frame // self._factor
        self._held = np.zeros(0, np.float32)  # at 48 kHz: less than a frame, waiting for the rest
        self._out = np.zeros(self.delay, np.int16)  # denoised at ``rate``, not yet returned
        self._using = threading.Lock()  # a feed (on a worker thread) and close: RNNoise's state freed after, not during

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """The next piece (int16 at ``rate``), denoised and ``delay`` late: as many samples."""
        with self._using:
            if self._state is None:
                raise RuntimeError("this noise reducer is closed")
            return self._feed(samples)

    def _feed(self, samples: np.ndarray) -> np.ndarray:
        wide = np.concatenate([self._held, self._up(samples.astype(np.float32))])
        whole = len(wide) // self._frame * self._frame
        self._held = wide[whole:]
        clean = np.empty(whole, np.float32)
        for at in range(0, whole, self._frame):  # in and out in int16's scale, as RNNoise takes them
            frame = np.ascontiguousarray(wide[at:at + self._frame])
            self._lib.rnnoise_process_frame(self._state, clean[at:].ctypes.data_as(_FLOAT_P),
                                            frame.ctypes.data_as(_FLOAT_P))
        down = np.clip(np.rint(self._down(clean)), -32768, 32767).astype(np.int16)
        self._out = np.concatenate([self._out, down])
        piece, self._out = self._out[:len(samples)], self._out[len(samples):]
        return piece  # the frame held back is at most ``delay`` samples: never short

    def _up(self, x: np.ndarray) -> np.ndarray:
        """``x`` at ``factor`` times its rate: output sample ``p`` of each ``factor`` is ``x``
        through the low-pass's phase ``p`` (polyphase: the zeros stuffed between samples skipped)."""
        if self._lowpass is None or not len(x):
            return x
        wide = np.concatenate([self._up_history, x.astype(np.float64)])
        self._up_history = wide[len(wide) - len(self._up_history):]
        y = np.empty(len(x) * self._factor, np.float32)
        for p, phase in enumerate(self._phases):
            y[p::self._factor] = np.convolve(wide, phase, "valid")
        return y

    def _down(self, x: np.ndarray) -> np.ndarray:
        """``x`` low-passed, then every ``factor``-th sample: a frame (480) is a whole number of
        steps, so each piece starts on one."""
        if self._lowpass is None or not len(x):
            return x
        wide = np.concatenate([self._down_history, x.astype(np.float64)])
        self._down_history = wide[len(wide) - len(self._down_history):]
        return np.convolve(wide, self._lowpass, "valid")[::self._factor]

    def close(self) -> None:
        """Free RNNoise's state, once a feed in progress has ended (again: nothing; a feed after it
        raises)."""
        with self._using:
            if self._state is not None:
                from pyrnnoise import rnnoise

                rnnoise.destroy(self._state)
                self._state = None


def time_stretch(x: np.ndarray, rate: float, n_fft: int = 512, hop: int = 128) -> np.ndarray:
    """Play ``x`` ``rate`` times faster at the same pitch (phase vocoder); length becomes len/rate."""
    if rate == 1.0 or len(x) < n_fft:
        return x.astype(np.float32, copy=False)
    from scipy.signal import istft, stft

    _, _, spec = stft(x, nperseg=n_fft, noverlap=n_fft - hop)
    pos = np.arange(0, spec.shape[1] - 1, rate)
    i, frac = pos.astype(int), (pos % 1.0)[None, :]
    left, right = spec[:, i], spec[:, i + 1]
    mag = (1 - frac) * np.abs(left) + frac * np.abs(right)
    omega = 2 * np.pi * hop * np.arange(spec.shape[0])[:, None] / n_fft
    dphi = np.angle(right) - np.angle(left) - omega
    dphi -= 2 * np.pi * np.round(dphi / (2 * np.pi))
    phase = np.angle(spec[:, :1]) + np.cumsum(np.concatenate([np.zeros_like(omega), (omega + dphi)[:, :-1]], 1), 1)
    _, y = istft(mag * np.exp(1j * phase), nperseg=n_fft, noverlap=n_fft - hop)
    n = round(len(x) / rate)
    return np.pad(y[:n], (0, max(0, n - len(y)))).astype(np.float32)


def _pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def encode_audio(x: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode a whole float32 mono signal as ``fmt`` (one of ``supported_speech_formats()``).

    ``pcm`` is raw 16-bit little-endian at ``sample_rate``. Formats that only allow some rates
    (opus, mp3) are resampled to the closest allowed rate at or above ``sample_rate``.
    """
    if fmt not in _AVAILABLE:
        raise ValueError(f"unsupported format {fmt!r}; supported: {', '.join(_AVAILABLE)}")
    if fmt == "pcm":
        return _pcm16(x)
    if fmt == "aac":
        return b"".join(_aac([x], sample_rate))
    container, subtype, rates = _SOUNDFILE_FORMATS[fmt]
    if rates is not None and sample_rate not in rates:
        target = min((r for r in rates if r >= sample_rate), default=rates[-1])
        x, sample_rate = resample(x, sample_rate, target), target
    buf = io.BytesIO()
    sf.write(buf, np.clip(x, -1.0, 1.0), sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def wav_stream_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header of unknown length (sizes 0xFFFFFFFF), for streamed PCM after it."""
    unknown = 0xFFFFFFFF
    fmt_chunk = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return struct.pack("<4sI4s", b"RIFF", unknown, b"WAVE") + fmt_chunk + struct.pack("<4sI", b"data", unknown)


def sized_wav(streamed: bytes) -> bytes:
    """A whole WAV streamed after ``wav_stream_header`` with its sizes written in, as a file
    made in one piece has them."""
    header = len(wav_stream_header(0))
    return (streamed[:4] + struct.pack("<I", len(streamed) - 8) + streamed[8:header - 4]
            + struct.pack("<I", len(streamed) - header) + streamed[header:])


def encode_stream(chunks: Iterable[np.ndarray], sample_rate: int, fmt: str) -> Iterator[bytes]:
    """Encode speech chunks as they arrive.

    ``wav`` (header of unknown length, then PCM) and ``pcm`` stream chunk by chunk, and ``aac``
    too (ADTS: each frame carries its own header; the encoder holds back a frame or two until the
    next chunk). ``flac``, ``mp3`` and ``opus`` are encoded once the last chunk has arrived:
    libsndfile rewrites their headers (FLAC STREAMINFO, the MP3 Xing frame) when the file is
    closed, and a stream without those rewrites decodes to the wrong length.
    """
    if fmt not in _AVAILABLE:
        raise ValueError(f"unsupported format {fmt!r}; supported: {', '.join(_AVAILABLE)}")
    if fmt == "aac":
        yield from _aac(chunks, sample_rate)
    elif fmt in ("wav", "pcm"):
        if fmt == "wav":
            yield wav_stream_header(sample_rate)
        for x in chunks:
            yield _pcm16(x)
    else:
        parts = list(chunks)
        whole = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        yield encode_audio(whole, sample_rate, fmt)


def _aac(chunks: Iterable[np.ndarray], sample_rate: int) -> Iterator[bytes]:
    """AAC-LC in ADTS frames (OpenAI's ``aac``), mono, by FFmpeg's encoder: the bytes each chunk
    completes, then the rest at the end. A rate AAC has no table entry for is resampled to the
    next one up."""
    import av

    rate = min((r for r in _AAC_RATES if r >= sample_rate), default=_AAC_RATES[-1])
    buf = io.BytesIO()

    def written() -> Iterator[bytes]:
        if buf.tell():
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()

    with av.open(buf, mode="w", format="adts") as out:
        stream = out.add_stream("aac", rate=rate)
        stream.layout = "mono"
        for x in chunks:  # one at a time, as the speech is made
            x = resample(x, sample_rate, rate) if rate != sample_rate else x
            frame = av.AudioFrame.from_ndarray(np.clip(x, -1.0, 1.0).astype(np.float32)[None, :], format="fltp",
                                               layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
            yield from written()
        for packet in stream.encode(None):
            out.mux(packet)
    yield from written()


class Timed(Protocol):
    """Anything with a start and end in seconds and a text (e.g. ``workers.stt.Segment``)."""

    start: float
    end: float
    text: str


def _timestamp(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(segments: Sequence[Timed]) -> str:
    """SubRip subtitles: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``."""
    cues = [
        f"{i}\n{_timestamp(s.start, ',')} --> {_timestamp(s.end, ',')}\n{s.text.strip()}\n"
        for i, s in enumerate(segments, 1)
    ]
    return "\n".join(cues)


def to_vtt(segments: Sequence[Timed]) -> str:
    """WebVTT subtitles: a ``WEBVTT`` header, then ``HH:MM:SS.mmm --> HH:MM:SS.mmm`` cues."""
    cues = [f"{_timestamp(s.start, '.')} --> {_timestamp(s.end, '.')}\n{s.text.strip()}\n" for s in segments]
    return "\n".join(["WEBVTT\n", *cues])
