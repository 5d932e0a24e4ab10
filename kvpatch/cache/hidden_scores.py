"""The scores a hidden-state policy gives each token of a compressed layer as it arrives,
kept so that what the layer holds can be ranked again: after a prefill chunk, an appended turn,
or under a decode budget."""

from __future__ import annotations

import dataclasses

import torch

from kvpatch.policies import HiddenStateScorer, LayerInputs, Policy


class HiddenScores:
    """Mixin of :class:`~kvpatch.cache.CompressedLayer`: ``token_scores`` ``[batch, kv_heads,
    seen]`` holds the score of every token seen by logical position (None for other policies),
    ``hidden_scorer`` the scorer that gave them."""

    hidden_scorer: HiddenStateScorer | None
    token_scores: torch.Tensor | None

    def _score_hidden_states(self, policy: Policy, inputs: LayerInputs) -> LayerInputs:
        """For a policy that scores hidden states, score the prefill's tokens once and remember
        the scores (the ``inputs`` returned carry them instead of the hidden states)."""
        if policy.hidden_state_scorer is None:
            return inputs  # (a policy reading the hidden states itself gets them)
        if inputs.hidden_scores is None:  # else scored when the layer was deferred
            self.hidden_scorer = policy.hidden_state_scorer
            if inputs.hidden_states is None:
                raise ValueError(
                    f"{policy.name!r} scores tokens from their hidden states, which only "
                    "kvpatch's attention on an enabled model records: call kvpatch.enable(model)"
                )
            hidden = inputs.hidden_states
            self.token_scores = self.hidden_scorer.hidden_scores(hidden, inputs.layer_idx)
        return dataclasses.replace(inputs, hidden_states=None, hidden_scores=self.token_scores)

    def remember_hidden_states(self, hidden: torch.Tensor | None) -> None:
        """Score the tokens just appended from their hidden states ``[batch, new, hidden]``,
        for a policy that ranks what is held by them."""
        if self.token_scores is None:
            return
        if hidden is None:
            raise ValueError(
                f"{self.policy.name!r} scores every token from its hidden state, but this forward "
                "gave the attention none (the model was not enabled with kvpatch.enable)"
            )
        scores = self.hidden_scorer.hidden_scores(hidden, self.setup.layer_idx)
        self.token_scores = torch.cat([self.token_scores, scores], dim=-1)

    def _held_scores(self) -> torch.Tensor | None:
        """The hidden-state scores of every slot of the store's dense layout, or None."""
        if self.token_scores is None:
            return None
        store = self.store
        if self.token_scores.shape[-1] != store.end:
            raise RuntimeError(
                f"the layer holds {store.end} tokens but scores of {self.token_scores.shape[-1]}"
            )
        positions = store.slot_positions().clamp(0, max(store.end - 1, 0))
        return self.token_scores.gather(-1, positions)
