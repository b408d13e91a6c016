//! Audio in: WAV, FLAC or MP3 bytes → 16 kHz mono samples in `[-1, 1)`, and
//! the 12B's frames (640 samples, 40 ms, one soft token each).

use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{DecoderOptions, CODEC_TYPE_NULL};
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

use crate::{MediaError, Result};

/// The sampling rate every Gemma 4 audio path takes.
pub const SAMPLE_RATE: u32 = 16_000;

/// Decoded audio: mono samples at [`SAMPLE_RATE`].
#[derive(Debug, Clone, PartialEq)]
pub struct Audio {
    pub samples: Vec<f32>,
}

impl Audio {
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / f64::from(SAMPLE_RATE)
    }
}

/// The containers [`decode_audio`] reads, told apart by their first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudioContainer {
    Wav,
    Flac,
    Mp3,
}

impl AudioContainer {
    /// The container of these bytes, if it is one of the supported ones.
    pub fn sniff(bytes: &[u8]) -> Option<Self> {
        match bytes {
            [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'A', b'V', b'E', ..] => Some(Self::Wav),
            [b'f', b'L', b'a', b'C', ..] => Some(Self::Flac),
            [b'I', b'D', b'3', ..] => Some(Self::Mp3),
            // An MPEG audio frame's sync word (layer III).
            [0xFF, b, ..] if b & 0xE0 == 0xE0 && b & 0x06 == 0x02 => Some(Self::Mp3),
            _ => None,
        }
    }
}

/// Decodes WAV, FLAC or MP3 (told apart by their first bytes, whatever the
/// request calls them) to 16 kHz mono, refusing clips over `max_seconds`
/// before decoding past that point.
pub fn decode_audio(bytes: &[u8], max_seconds: f64) -> Result<Audio> {
    match AudioContainer::sniff(bytes) {
        Some(AudioContainer::Wav) => decode_wav(bytes, max_seconds),
        Some(AudioContainer::Flac) => decode_compressed(bytes, "flac", max_seconds),
        Some(AudioContainer::Mp3) => decode_compressed(bytes, "mp3", max_seconds),
        None => Err(MediaError::UnsupportedAudio),
    }
}

/// FLAC or MP3 through symphonia: channels averaged to mono, then resampled
/// as WAV is.
fn decode_compressed(bytes: &[u8], extension: &str, max_seconds: f64) -> Result<Audio> {
    let bad = |e: SymphoniaError| {
        MediaError::AudioDecode(format!("not a readable {extension} file: {e}"))
    };
    let source = MediaSourceStream::new(
        Box::new(std::io::Cursor::new(bytes.to_vec())),
        Default::default(),
    );
    let mut hint = Hint::new();
    hint.with_extension(extension);
    let format_options = FormatOptions {
        enable_gapless: true,
        ..Default::default()
    };
    let probed = symphonia::default::get_probe()
        .format(&hint, source, &format_options, &MetadataOptions::default())
        .map_err(bad)?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| {
            MediaError::AudioDecode(format!("the {extension} file has no audio track"))
        })?;
    let track_id = track.id;
    let params = track.codec_params.clone();
    // The header's length, where it states one: refuse before decoding.
    if let (Some(frames), Some(rate)) = (params.n_frames, params.sample_rate) {
        let seconds = frames as f64 / f64::from(rate.max(1));
        if seconds > max_seconds {
            return Err(MediaError::TooLong {
                seconds,
                max_seconds,
            });
        }
    }
    let mut decoder = symphonia::default::get_codecs()
        .make(&params, &DecoderOptions::default())
        .map_err(bad)?;
    let mut mono = Vec::new();
    let mut rate = params.sample_rate.unwrap_or(0);
    let mut buffer: Option<SampleBuffer<f32>> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            Err(SymphoniaError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break
            }
            Err(e) => return Err(bad(e)),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let decoded = decoder.decode(&packet).map_err(bad)?;
        let spec = *decoded.spec();
        rate = spec.rate;
        let channels = spec.channels.count().max(1);
        let needed = decoded.capacity() as u64;
        let buf = match &mut buffer {
            Some(b) if b.capacity() as u64 >= needed * channels as u64 => b,
            _ => buffer.insert(SampleBuffer::new(needed, spec)),
        };
        buf.copy_interleaved_ref(decoded);
        for frame in buf.samples().chunks_exact(channels) {
            mono.push(frame.iter().sum::<f32>() / channels as f32);
        }
        let seconds = mono.len() as f64 / f64::from(rate.max(1));
        if seconds > max_seconds {
            return Err(MediaError::TooLong {
                seconds,
                max_seconds,
            });
        }
    }
    if mono.is_empty() || rate == 0 {
        return Err(MediaError::Empty);
    }
    Ok(Audio {
        samples: resample(&mono, rate),
    })
}

/// Decodes a RIFF/WAVE file (PCM 8/16/24/32-bit or IEEE float 32/64-bit,
/// any channel count, any rate): channels are averaged to mono and other
/// rates resampled linearly to 16 kHz. 16-bit samples become `s / 32768`,
/// as `soundfile` and `librosa` read them.
pub fn decode_wav(bytes: &[u8], max_seconds: f64) -> Result<Audio> {
    let bad = |why: &str| MediaError::AudioDecode(format!("not a readable WAV file: {why}"));
    if bytes.len() < 12 || &bytes[0..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return Err(MediaError::UnsupportedAudio);
    }
    let mut at = 12;
    let mut format = None;
    let mut data = None;
    while at + 8 <= bytes.len() {
        let id = &bytes[at..at + 4];
        let len = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]])
            as usize;
        let body = bytes
            .get(at + 8..at + 8 + len)
            .ok_or_else(|| bad("a chunk runs past the end"))?;
        match id {
            b"fmt " if len >= 16 => {
                let u16_at = |i: usize| u16::from_le_bytes([body[i], body[i + 1]]);
                let mut tag = u16_at(0);
                if tag == 0xFFFE && len >= 26 {
                    // WAVE_FORMAT_EXTENSIBLE: the sub-format's first two bytes.
                    tag = u16_at(24);
                }
                format = Some((
                    tag,
                    u16_at(2),
                    u32::from_le_bytes([body[4], body[5], body[6], body[7]]),
                    u16_at(14),
                ));
            }
            b"data" => data = Some(body),
            _ => {}
        }
        at += 8 + len + (len & 1);
    }
    let (tag, channels, rate, bits) = format.ok_or_else(|| bad("no fmt chunk"))?;
    let data = data.ok_or_else(|| bad("no data chunk"))?;
    if channels == 0 || rate == 0 {
        return Err(bad("zero channels or sample rate"));
    }
    let width = usize::from(bits / 8);
    let sample = |b: &[u8]| -> Option<f32> {
        Some(match (tag, bits) {
            (1, 8) => (f32::from(b[0]) - 128.0) / 128.0,
            (1, 16) => f32::from(i16::from_le_bytes([b[0], b[1]])) / 32768.0,
            (1, 24) => (i32::from_le_bytes([0, b[0], b[1], b[2]]) >> 8) as f32 / 8_388_608.0,
            (1, 32) => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32 / 2_147_483_648.0,
            (3, 32) => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            (3, 64) => f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32,
            _ => return None,
        })
    };
    let frame = width * usize::from(channels);
    let frames = data.len() / frame.max(1);
    let seconds = frames as f64 / f64::from(rate);
    if seconds > max_seconds {
        return Err(MediaError::TooLong {
            seconds,
            max_seconds,
        });
    }
    let mut mono = Vec::with_capacity(frames);
    for f in data.chunks_exact(frame) {
        let mut sum = 0f32;
        for c in f.chunks_exact(width) {
            sum += sample(c).ok_or(MediaError::UnsupportedAudio)?;
        }
        mono.push(sum / f32::from(channels));
    }
    if mono.is_empty() {
        return Err(MediaError::Empty);
    }
    Ok(Audio {
        samples: resample(&mono, rate),
    })
}

/// Linear resampling to 16 kHz (identity at 16 kHz).
fn resample(samples: &[f32], rate: u32) -> Vec<f32> {
    if rate == SAMPLE_RATE {
        return samples.to_vec();
    }
    let ratio = f64::from(rate) / f64::from(SAMPLE_RATE);
    let out_len = ((samples.len() as f64) / ratio).floor().max(1.0) as usize;
    (0..out_len)
        .map(|i| {
            let x = i as f64 * ratio;
            let j = x.floor() as usize;
            let t = (x - j as f64) as f32;
            let a = samples[j.min(samples.len() - 1)];
            let b = samples[(j + 1).min(samples.len() - 1)];
            a + (b - a) * t
        })
        .collect()
}

/// The 12B's audio features: `frame`-sample frames (the last zero-padded),
/// `[frames, frame]` row-major.
pub fn frames(audio: &Audio, frame: usize) -> Vec<f32> {
    let n = audio.samples.len().div_ceil(frame);
    let mut out = audio.samples.clone();
    out.resize(n * frame, 0.0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wav(channels: u16, rate: u32, samples: &[i16]) -> Vec<u8> {
        let data: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
        let mut out = Vec::new();
        out.extend_from_slice(b"RIFF");
        out.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
        out.extend_from_slice(b"WAVEfmt ");
        out.extend_from_slice(&16u32.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&channels.to_le_bytes());
        out.extend_from_slice(&rate.to_le_bytes());
        out.extend_from_slice(&(rate * 2 * u32::from(channels)).to_le_bytes());
        out.extend_from_slice(&(2 * channels).to_le_bytes());
        out.extend_from_slice(&16u16.to_le_bytes());
        out.extend_from_slice(b"data");
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&data);
        out
    }

    #[test]
    fn sixteen_bit_mono_reads_as_samples_over_32768() {
        let a = decode_wav(&wav(1, 16_000, &[0, 16384, -32768, 32767]), 30.0).unwrap();
        assert_eq!(a.samples, [0.0, 0.5, -1.0, 32767.0 / 32768.0]);
    }

    #[test]
    fn stereo_is_averaged_and_other_rates_resampled() {
        let a = decode_wav(&wav(2, 16_000, &[16384, 0, 0, 16384]), 30.0).unwrap();
        assert_eq!(a.samples, [0.25, 0.25]);
        let a = decode_wav(&wav(1, 32_000, &[0, 100, 200, 300, 400, 500]), 30.0).unwrap();
        assert_eq!(a.samples.len(), 3);
        assert_eq!(a.samples[1], 200.0 / 32768.0);
    }

    #[test]
    fn frames_pad_the_last_one_with_zeros() {
        let a = Audio {
            samples: vec![1.0; 5],
        };
        assert_eq!(frames(&a, 4), [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn containers_are_told_apart_by_their_first_bytes() {
        assert_eq!(
            AudioContainer::sniff(&wav(1, 16_000, &[0; 4])),
            Some(AudioContainer::Wav)
        );
        assert_eq!(
            AudioContainer::sniff(b"fLaC\0\0"),
            Some(AudioContainer::Flac)
        );
        assert_eq!(AudioContainer::sniff(b"ID3\x04"), Some(AudioContainer::Mp3));
        assert_eq!(
            AudioContainer::sniff(&[0xFF, 0xFB, 0x90, 0x00]),
            Some(AudioContainer::Mp3)
        );
        assert_eq!(AudioContainer::sniff(b"OggS\0"), None);
        assert!(matches!(
            decode_audio(b"fLaC but nothing else", 30.0),
            Err(MediaError::AudioDecode(_))
        ));
    }

    #[test]
    fn bad_or_long_audio_is_an_error() {
        assert!(matches!(
            decode_wav(b"ID3 not a wav", 30.0),
            Err(MediaError::UnsupportedAudio)
        ));
        let mut cut = wav(1, 16_000, &[1; 100]);
        cut.truncate(60);
        assert!(matches!(
            decode_wav(&cut, 30.0),
            Err(MediaError::AudioDecode(_))
        ));
        let long = wav(1, 16_000, &vec![0; 32_000]);
        assert!(matches!(
            decode_wav(&long, 1.5),
            Err(MediaError::TooLong { .. })
        ));
    }
}
