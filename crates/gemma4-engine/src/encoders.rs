//! The media encoders behind the executor seam, on a thread of their own:
//! an image or a clip is encoded beside the model's steps, so the running
//! streams keep decoding while it encodes, and the chunk that reads its rows
//! is scheduled once the rows are there. The encoder shares the kernel pool
//! with the steps: a kernel call that finds the pool busy runs on the
//! encoder's own thread.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use gemma4_model::{AudioEncoder, ImageEncoder, VisionInput};

use crate::executor::ExecutorError;
use crate::media::{AudioFacts, EncoderInput, ImageFacts, MediaFacts, SoftPrompt};
use crate::panic_message;

struct Job {
    seq_id: u64,
    item: usize,
    prompt: Arc<SoftPrompt>,
}

/// An item's rows, `[soft_tokens, hidden]` row-major, or why it failed.
pub struct Encoded {
    pub seq_id: u64,
    pub item: usize,
    pub rows: Result<Vec<f32>, String>,
}

/// The encoders' thread, and the items it has yet to finish.
pub struct EncoderThread {
    facts: MediaFacts,
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Encoded>,
    /// `(request, item)` queued and not yet taken back.
    in_flight: Vec<(u64, usize)>,
}

impl EncoderThread {
    /// Moves the encoders to a thread of their own.
    pub fn spawn(
        images: Option<ImageEncoder>,
        audio: Option<AudioEncoder>,
    ) -> Result<Self, ExecutorError> {
        let facts = media_facts(images.as_ref(), audio.as_ref());
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("gemma4-encoders".into())
            .spawn(move || {
                for job in inbox {
                    let rows = match job.prompt.items.get(job.item) {
                        Some(item) => encode(images.as_ref(), audio.as_ref(), &item.input),
                        None => Err(format!("the request has no media item {}", job.item)),
                    };
                    let encoded = Encoded {
                        seq_id: job.seq_id,
                        item: job.item,
                        rows,
                    };
                    if outbox.send(encoded).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| ExecutorError(format!("cannot start the encoder thread: {e}")))?;
        Ok(Self {
            facts,
            jobs,
            done,
            in_flight: Vec::new(),
        })
    }

    pub fn facts(&self) -> &MediaFacts {
        &self.facts
    }

    /// Queues an item of a request's prompt.
    pub fn start(
        &mut self,
        seq_id: u64,
        item: usize,
        prompt: Arc<SoftPrompt>,
    ) -> Result<(), String> {
        self.jobs
            .send(Job {
                seq_id,
                item,
                prompt,
            })
            .map_err(|_| "the encoder thread has stopped".to_string())?;
        self.in_flight.push((seq_id, item));
        Ok(())
    }

    /// Whether some item is queued and not yet taken back.
    pub fn busy(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// The items finished so far; with `wait`, waits up to that long for
    /// the first when none has finished (and some is under way).
    pub fn finished(&mut self, wait: Option<Duration>) -> Vec<Encoded> {
        let mut out = Vec::new();
        let mut lost = false;
        if let Some(wait) = wait.filter(|_| self.busy()) {
            match self.done.recv_timeout(wait) {
                Ok(e) => out.push(e),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => lost = true,
            }
        }
        while !lost {
            match self.done.try_recv() {
                Ok(e) => out.push(e),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => lost = true,
            }
        }
        for e in &out {
            self.in_flight.retain(|&job| job != (e.seq_id, e.item));
        }
        if lost && self.busy() {
            // What the thread held will never come: those requests fail.
            tracing::error!(
                items = self.in_flight.len(),
                "the encoder thread has stopped"
            );
            out.extend(self.in_flight.drain(..).map(|(seq_id, item)| Encoded {
                seq_id,
                item,
                rows: Err("the encoder thread has stopped".into()),
            }));
        }
        out
    }
}

/// One item's rows, `[soft_tokens, hidden]` row-major. A panic in an
/// encoder fails the request that brought the item.
fn encode(
    images: Option<&ImageEncoder>,
    audio: Option<&AudioEncoder>,
    input: &EncoderInput,
) -> Result<Vec<f32>, String> {
    let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match input {
        EncoderInput::Embeds(rows) => Ok(Some(rows.clone())),
        EncoderInput::Image { patches, positions } => images
            .map(|e| {
                e.encode(VisionInput { patches, positions })
                    .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
            })
            .transpose(),
        EncoderInput::Audio { features } => audio
            .map(|e| {
                e.encode(features)
                    .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
            })
            .transpose(),
    }));
    match encoded {
        Ok(Ok(Some(rows))) => Ok(rows),
        Ok(Ok(None)) => Err("this model has no encoder for the media sent".into()),
        Ok(Err(e)) => Err(format!("the media encoder failed: {e}")),
        Err(payload) => Err(format!(
            "the media encoder panicked: {}",
            panic_message(payload.as_ref())
        )),
    }
}

/// What the encoders take and give, for the engine and the server.
pub fn media_facts(images: Option<&ImageEncoder>, audio: Option<&AudioEncoder>) -> MediaFacts {
    MediaFacts {
        image: images.map(|e| {
            let (patch_size, pooling) = e.patch_geometry();
            ImageFacts {
                tokens: e.tokens(),
                video_tokens: e.video_tokens(),
                patch_size,
                pooling,
                merged_patches: e.takes_merged_patches(),
                position_table: e.position_table(),
            }
        }),
        audio: audio.map(|e| AudioFacts {
            tokens: e.tokens(),
            features: e.features(),
        }),
    }
}
