"""Pure tensor math of the training stages: advantages, log-probs, policy losses, KL, loss aggregation.

No model, trainer or config imports: every function takes tensors and plain numbers, so each one is
tested on hand-computed values and against a slow loop (tests/test_algos.py). The math is split by
topic into submodules (advantages, logprobs, losses, ppo, preference); import it from here.

Shapes: B sequences, T token positions, V vocabulary. `mask` is bool or 0/1 `[B, T]`; masked-out
positions never reach a sum (they are selected away, so a NaN or inf there does not leak in).
"""

from trainfit.algos.advantages import (ADVANTAGE_ESTIMATORS, ADVANTAGES, advantages, group_advantages, reinforce_pp_advantages,
                                       rloo_advantages)
from trainfit.algos.core import IGNORE_INDEX, Number, masked_mean, masked_sum
from trainfit.algos.fused_head import FUSED_CHUNK_ROWS, linear_token_logprobs
from trainfit.algos.logprobs import (entropy_sum, shifted_logprobs, token_entropy, token_logprobs,
                                     token_logprobs_rows)
from trainfit.algos.offpolicy import (OFF_POLICY, behaviour_weights, decoupled_importance, importance_stats,
                                      no_importance, staleness_stats, truncated_importance)
from trainfit.algos.ppo import AdaptiveKL, clipped_value_loss, gae, last_positions, token_rewards, whiten
from trainfit.algos.losses import (AGG_MODES, LOSS_AGG, agg_loss, bradley_terry_loss, clipped_policy_loss, grpo_loss, kl_penalty,
                                   nll_mean, sequence_log_ratio, sft_loss)
from trainfit.algos.preference import (PREFERENCE_LOSSES, PairLogps, implicit_rewards, kto_loss, kto_reference_point,
                                       preference_loss, register_preference_loss)

__all__ = [
    "AdaptiveKL", "clipped_value_loss", "gae", "last_positions", "token_rewards", "whiten",
    "ADVANTAGE_ESTIMATORS", "ADVANTAGES", "AGG_MODES", "FUSED_CHUNK_ROWS", "linear_token_logprobs", "bradley_terry_loss", "IGNORE_INDEX", "LOSS_AGG", "Number", "advantages", "agg_loss",
    "clipped_policy_loss", "entropy_sum", "group_advantages", "grpo_loss", "kl_penalty", "masked_mean",
    "masked_sum", "nll_mean", "reinforce_pp_advantages", "rloo_advantages", "sequence_log_ratio",
    "sft_loss", "shifted_logprobs", "token_entropy", "token_logprobs", "token_logprobs_rows",
    "PREFERENCE_LOSSES", "PairLogps", "implicit_rewards", "kto_loss", "kto_reference_point", "preference_loss",
    "register_preference_loss",
    "OFF_POLICY", "behaviour_weights", "decoupled_importance", "importance_stats", "no_importance",
    "staleness_stats", "truncated_importance",
]
