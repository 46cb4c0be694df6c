//! Pushing the journal: this instance's new events appended to the stream in numbered batches,
//! each sent again as it is until Redis acknowledges it.

use super::Syncer;
use crate::shared::journal::{Event, Journal};
use crate::shared::namespace::{redis_err, timed, SharedError};
use redis::aio::MultiplexedConnection;

/// Most observations in one pushed batch.
const BATCH_MAX: usize = 5_000;

/// A batch being pushed; sent again as it is until Redis acknowledges it.
#[derive(Debug)]
pub(super) struct Batch {
    number: u64,
    last_seq: u64,
    bytes: Vec<u8>,
    /// The rollout candidates' observations (the `r` field; empty: none).
    rollout: Vec<u8>,
    /// The rollouts' ends (the `e` field; empty: none).
    ends: Vec<u8>,
}

impl Syncer {
    /// Pushes the journal's new events, one batch at a time; returns how many.
    pub(super) async fn push(
        &mut self,
        conn: &mut MultiplexedConnection,
        journal: &Journal,
    ) -> Result<usize, SharedError> {
        let mut pushed = 0;
        loop {
            if self.in_flight.is_none() {
                let events = journal.after(self.pushed, BATCH_MAX);
                let Some(&(last_seq, _)) = events.last() else {
                    break;
                };
                let (mut list, mut rollout, mut ends) = (Vec::new(), Vec::new(), Vec::new());
                for (_, e) in &events {
                    match e {
                        Event::RolloutLearn { .. } => rollout.push(e),
                        Event::RolloutEnd { .. } => ends.push(e),
                        _ => list.push(e),
                    }
                }
                let bytes = rmp_serde::to_vec_named(&list).map_err(|e| redis_err(&e))?;
                let field = |events: &[&Event]| {
                    if events.is_empty() {
                        Ok(Vec::new())
                    } else {
                        rmp_serde::to_vec_named(events).map_err(|e| redis_err(&e))
                    }
                };
                let (rollout, ends) = (field(&rollout)?, field(&ends)?);
                self.batches += 1;
                self.pushed = last_seq;
                pushed += events.len();
                self.in_flight = Some(Batch {
                    number: self.batches,
                    last_seq,
                    bytes,
                    rollout,
                    ends,
                });
            }
            if let Some(batch) = &self.in_flight {
                let _: i64 = timed(
                    self.push_script
                        .key(&self.keys.log)
                        .key(&self.keys.acks)
                        .arg(&self.instance)
                        .arg(batch.number)
                        .arg(batch.last_seq)
                        .arg(batch.bytes.as_slice())
                        .arg(batch.rollout.as_slice())
                        .arg(batch.ends.as_slice())
                        .invoke_async(conn),
                )
                .await?;
            }
            self.last_acked = self.in_flight.take();
        }
        Ok(pushed)
    }
}
