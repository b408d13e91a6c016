//! Faults injected on purpose, to test how the engine survives them. Only
//! built with the `fault-injection` feature, and only reachable through
//! [`crate::engine::start_with_fault`].

use gemma4_model::BatchSeq;

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The model step panics.
    ModelPanics,
    /// The model step returns an error.
    ModelFails,
    /// The engine's bookkeeping panics (outside the model step).
    BookkeepingPanics,
}

/// A fault that strikes every step in which a sequence holds `trigger_token`
/// (in the tokens the model step sees, or anywhere in the sequence for
/// [`Fault::BookkeepingPanics`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    pub trigger_token: u32,
    pub fault: Fault,
}

impl FaultPlan {
    pub(crate) fn in_model_step(&self, batch: &[BatchSeq<'_>]) -> gemma4_model::Result<()> {
        if !batch.iter().any(|s| s.ids.contains(&self.trigger_token)) {
            return Ok(());
        }
        match self.fault {
            Fault::ModelPanics => panic!("injected fault: model step panics"),
            Fault::ModelFails => Err(gemma4_model::ModelError::Input(
                "injected fault: model step fails".into(),
            )),
            Fault::BookkeepingPanics => Ok(()),
        }
    }

    pub(crate) fn in_bookkeeping(&self, seqs: &[&[u32]]) {
        if self.fault == Fault::BookkeepingPanics
            && seqs.iter().any(|s| s.contains(&self.trigger_token))
        {
            panic!("injected fault: bookkeeping panics");
        }
    }
}
