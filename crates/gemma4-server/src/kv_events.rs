//! The prefix cache's events over ZeroMQ, as vLLM publishes them, so a
//! prefix-aware router (llm-d's endpoint picker) can send each request to
//! the replica that already holds its prefix.
//!
//! A PUB socket bound at `--kv-events-endpoint` sends one multipart message
//! per engine step that changed the cache: the topic, a sequence number (8
//! bytes, big-endian, from 0), and a MessagePack payload
//! `[timestamp, events, 0]` (the last is the data-parallel rank). Each event
//! is a positional array, in the layout of vLLM's `array_like` events with
//! the hybrid-cache fields (what llm-d's kv-cache indexer decodes):
//! `["BlockStored", [hash], parent_hash | nil, token_ids, block_size,
//! lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//! kv_cache_spec_sliding_window]` (LoRA fields and the medium nil;
//! `extra_keys` is `[nil]`, or `[[[identifier, offset], …]]` for a block
//! that overlaps media; the kind `"full_attention"` or `"sliding_window"`
//! with the window) and `["BlockRemoved", [hash], medium, group_idx]`.
//! Every KV group reports its own blocks; hashes are vLLM's `sha256_cbor`
//! block hashes in their integer form (`gemma4_engine::block_hash`).
//!
//! The socket is `zeromq`, a pure-Rust implementation: no C library to
//! link, so the static binary stays static. PUB drops messages for a slow
//! subscriber rather than wait, and the engine hands its events over a
//! bounded queue without waiting either: a router that cannot keep up
//! loses events, never slows generation. Each step's batch takes its
//! sequence number before it is queued, so a batch dropped at a full queue
//! leaves a gap a subscriber can see.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use gemma4_engine::{KvEvent, KvEventSink};
use rmp::encode::{self, ByteBuf, ValueWriteError};
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Engine steps whose events may wait for the socket; more are dropped.
const QUEUE_STEPS: usize = 4096;

/// Where and under which topic events are published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// A ZeroMQ endpoint to bind, such as `tcp://*:5557`.
    pub endpoint: String,
    pub topic: String,
    /// Tokens per KV block, as the engine is configured.
    pub block_size: usize,
}

/// The topic when none is given: `kv@<host>@<model>`, vLLM's form.
pub fn default_topic(host: &str, model: &str) -> String {
    format!("kv@{host}@{model}")
}

/// Binds the socket and starts publishing; the returned sink goes into the
/// engine's configuration.
pub async fn publish(config: KvEventsConfig) -> Result<KvEventSink, String> {
    let mut socket = zeromq::PubSocket::new();
    let bound = socket
        .bind(&config.endpoint)
        .await
        .map_err(|e| format!("cannot bind --kv-events-endpoint {}: {e}", config.endpoint))?;
    tracing::info!(endpoint = %bound, topic = %config.topic, "publishing KV-cache events");
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, Vec<KvEvent>)>(QUEUE_STEPS);
    tokio::spawn(async move {
        while let Some((sequence, events)) = rx.recv().await {
            let payload = payload(unix_seconds(), &events, config.block_size);
            let frames: Vec<axum::body::Bytes> = vec![
                config.topic.clone().into_bytes().into(),
                sequence.to_be_bytes().to_vec().into(),
                payload.into(),
            ];
            let Ok(message) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(e) = socket.send(message).await {
                tracing::warn!("cannot publish KV-cache events: {e}");
            }
        }
    });
    Ok(numbered(tx))
}

/// The engine's side of the queue: each step's batch takes the next number,
/// then is queued if there is room and dropped if not, so a dropped batch
/// leaves a gap in the numbers subscribers see.
fn numbered(tx: tokio::sync::mpsc::Sender<(u64, Vec<KvEvent>)>) -> KvEventSink {
    let dropped = AtomicU64::new(0);
    let sequence = AtomicU64::new(0);
    KvEventSink(Arc::new(move |events| {
        let number = sequence.fetch_add(1, Ordering::Relaxed);
        if tx.try_send((number, events)).is_err() && dropped.fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::warn!(
                "KV-cache events are published slower than the engine makes them; some are dropped"
            );
        }
    }))
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The MessagePack payload of one message: `[timestamp, events, 0]`.
pub fn payload(timestamp: f64, events: &[KvEvent], block_size: usize) -> Vec<u8> {
    let mut out = ByteBuf::new();
    match write_payload(&mut out, timestamp, events, block_size) {
        Ok(()) => out.into_vec(),
        // Writing into a Vec cannot fail.
        Err(
            ValueWriteError::InvalidMarkerWrite(never) | ValueWriteError::InvalidDataWrite(never),
        ) => match never {},
    }
}

type Written = Result<(), ValueWriteError<Infallible>>;

fn write_payload(
    out: &mut ByteBuf,
    timestamp: f64,
    events: &[KvEvent],
    block_size: usize,
) -> Written {
    encode::write_array_len(out, 3)?;
    encode::write_f64(out, timestamp)?;
    encode::write_array_len(out, events.len() as u32)?;
    for event in events {
        write_event(out, event, block_size)?;
    }
    // The data-parallel rank: one engine.
    encode::write_uint(out, 0)?;
    Ok(())
}

fn nil(out: &mut ByteBuf) -> Written {
    encode::write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)
}

fn write_event(out: &mut ByteBuf, event: &KvEvent, block_size: usize) -> Written {
    match event {
        KvEvent::BlockStored {
            group,
            sliding_window,
            hash,
            parent,
            token_ids,
            media,
            adapter,
        } => {
            encode::write_array_len(out, 12)?;
            encode::write_str(out, "BlockStored")?;
            encode::write_array_len(out, 1)?;
            encode::write_uint(out, *hash)?;
            match parent {
                Some(p) => encode::write_uint(out, *p).map(drop)?,
                None => nil(out)?,
            }
            encode::write_array_len(out, token_ids.len() as u32)?;
            for &id in token_ids {
                encode::write_uint(out, u64::from(id))?;
            }
            encode::write_uint(out, block_size as u64)?;
            // The LoRA adapter's id, the medium (left to the reader's
            // default), the adapter's name.
            match adapter {
                Some(a) => encode::write_uint(out, u64::from(a.id)).map(drop)?,
                None => nil(out)?,
            }
            nil(out)?;
            match adapter {
                Some(a) => encode::write_str(out, &a.name)?,
                None => nil(out)?,
            }
            // One entry per hash: the block's media keys, or nil.
            encode::write_array_len(out, 1)?;
            if media.is_empty() {
                nil(out)?;
            } else {
                encode::write_array_len(out, media.len() as u32)?;
                for (identifier, offset) in media {
                    encode::write_array_len(out, 2)?;
                    encode::write_str(out, identifier)?;
                    encode::write_sint(out, *offset)?;
                }
            }
            encode::write_uint(out, *group as u64)?;
            match sliding_window {
                Some(window) => {
                    encode::write_str(out, "sliding_window")?;
                    encode::write_uint(out, *window as u64)?;
                }
                None => {
                    encode::write_str(out, "full_attention")?;
                    nil(out)?;
                }
            }
        }
        KvEvent::BlockRemoved { group, hash } => {
            encode::write_array_len(out, 4)?;
            encode::write_str(out, "BlockRemoved")?;
            encode::write_array_len(out, 1)?;
            encode::write_uint(out, *hash)?;
            nil(out)?;
            encode::write_uint(out, *group as u64)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gemma4_engine::AdapterKey;

    #[test]
    fn a_dropped_batch_leaves_a_gap_in_the_numbers() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let sink = numbered(tx);
        let removed = |hash| vec![KvEvent::BlockRemoved { group: 0, hash }];
        // The queue holds one batch: the next two are dropped.
        for hash in 0..3 {
            (sink.0)(removed(hash));
        }
        assert_eq!(rx.try_recv().ok(), Some((0, removed(0))));
        (sink.0)(removed(3));
        assert_eq!(rx.try_recv().ok(), Some((3, removed(3))));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn payloads_are_positional_msgpack_arrays() {
        let events = [
            KvEvent::BlockStored {
                group: 1,
                sliding_window: None,
                hash: u64::MAX,
                parent: None,
                token_ids: vec![2, 300],
                media: vec![],
                adapter: None,
            },
            KvEvent::BlockStored {
                group: 0,
                sliding_window: Some(512),
                hash: 7,
                parent: Some(u64::MAX),
                token_ids: vec![1],
                media: vec![("ab".into(), -3)],
                adapter: Some(AdapterKey {
                    id: 2,
                    name: "tone".into(),
                }),
            },
            KvEvent::BlockRemoved { group: 0, hash: 7 },
        ];
        let bytes = payload(1.5, &events, 16);
        let mut expected = vec![0x93, 0xcb];
        expected.extend(1.5f64.to_be_bytes());
        expected.push(0x93);
        // ["BlockStored", [u64::MAX], nil, [2, 300], 16, nil, nil, nil, [nil],
        //  1, "full_attention", nil]
        expected.extend([0x9c, 0xab]);
        expected.extend(b"BlockStored");
        expected.extend([0x91, 0xcf]);
        expected.extend(u64::MAX.to_be_bytes());
        expected.extend([0xc0, 0x92, 0x02, 0xcd, 0x01, 0x2c, 0x10, 0xc0, 0xc0, 0xc0]);
        expected.extend([0x91, 0xc0, 0x01, 0xae]);
        expected.extend(b"full_attention");
        expected.push(0xc0);
        // ["BlockStored", [7], u64::MAX, [1], 16, 2, nil, "tone", [[["ab", -3]]],
        //  0, "sliding_window", 512]
        expected.extend([0x9c, 0xab]);
        expected.extend(b"BlockStored");
        expected.extend([0x91, 0x07, 0xcf]);
        expected.extend(u64::MAX.to_be_bytes());
        expected.extend([0x91, 0x01, 0x10, 0x02, 0xc0, 0xa4]);
        expected.extend(b"tone");
        expected.extend([0x91, 0x91, 0x92, 0xa2]);
        expected.extend(b"ab");
        expected.extend([0xfd, 0x00, 0xae]);
        expected.extend(b"sliding_window");
        expected.extend([0xcd, 0x02, 0x00]);
        // ["BlockRemoved", [7], nil, 0]
        expected.extend([0x94, 0xac]);
        expected.extend(b"BlockRemoved");
        expected.extend([0x91, 0x07, 0xc0, 0x00]);
        // The data-parallel rank.
        expected.push(0x00);
        assert_eq!(bytes, expected);
    }
}
