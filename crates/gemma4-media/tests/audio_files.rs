//! The test clip as WAV, FLAC and MP3 (`tests/fixtures/vision/audio`, written
//! by `tools/make_vision_fixture.py` with soundfile): FLAC is lossless, so it
//! decodes to the WAV's samples exactly; MP3 is lossy, so it must keep the
//! clip's length and loudness and stay close to it sample by sample.

use std::path::PathBuf;

use gemma4_media::audio::{decode_audio, decode_wav};
use gemma4_media::MediaError;

fn clip(ext: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vision/audio")
        .join(format!("0.{ext}"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64).sqrt()
}

#[test]
fn flac_decodes_to_the_wav_samples() {
    let wav = decode_wav(&clip("wav"), 30.0).expect("wav");
    let flac = decode_audio(&clip("flac"), 30.0).expect("flac");
    assert_eq!(wav.samples.len(), 20_800);
    assert_eq!(flac.samples, wav.samples);
    assert_eq!(decode_audio(&clip("wav"), 30.0).expect("wav"), wav);
}

#[test]
fn mp3_keeps_the_clip_length_and_loudness() {
    let wav = decode_wav(&clip("wav"), 30.0).expect("wav");
    let mp3 = decode_audio(&clip("mp3"), 30.0).expect("mp3");
    let (a, b) = (wav.samples.len() as f64, mp3.samples.len() as f64);
    assert!((a - b).abs() / a < 0.06, "{a} vs {b} samples");
    let (ra, rb) = (rms(&wav.samples), rms(&mp3.samples));
    assert!((ra - rb).abs() / ra < 0.1, "rms {ra} vs {rb}");
    // Aligned at the best of a few offsets (encoder delay), the error is
    // well below the signal.
    let n = wav.samples.len().min(mp3.samples.len()) - 2_000;
    let best = (0..1_500)
        .map(|off| {
            let err: Vec<f32> = (0..n)
                .map(|i| mp3.samples[i + off] - wav.samples[i])
                .collect();
            rms(&err)
        })
        .fold(f64::INFINITY, f64::min);
    eprintln!("mp3: {b} samples (wav {a}), rms {rb:.4} (wav {ra:.4}), aligned error rms {best:.4}");
    assert!(best < 0.2 * ra, "error {best} against rms {ra}");
}

#[test]
fn long_or_cut_compressed_clips_are_refused() {
    assert!(matches!(
        decode_audio(&clip("flac"), 1.0),
        Err(MediaError::TooLong { .. })
    ));
    assert!(matches!(
        decode_audio(&clip("mp3"), 1.0),
        Err(MediaError::TooLong { .. })
    ));
    let mut cut = clip("flac");
    cut.truncate(40);
    assert!(decode_audio(&cut, 30.0).is_err());
}
