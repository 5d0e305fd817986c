"""Every tuning constant of the speculation policies, each named and explained once: what it is, its unit, and why
this value. The modules of specgate.serving.policy import them from here; docstrings refer to them by name."""

# --- policy names and search range ---------------------------------------------------------------------------
POLICY_NAMES = ("adaptive", "fixed", "table", "off")  # what `specgate serve --policy` and make_policy accept

# Draft tokens (gamma) when `--policy fixed` gives none: the middle of 0..DEFAULT_GAMMA_MAX, neither the widest
# plan (best alone, wasteful under load) nor off.
DEFAULT_FIXED_GAMMA = 4

# The widest plan the adaptive policy may choose (draft tokens per request per step). 8 because at concurrency 1,
# where speculation pays most, the best fixed gamma on the reference models is 8; wider plans are rarely accepted
# far enough to pay and cost calibration time (the grid grows with it, see calibration_tokens).
DEFAULT_GAMMA_MAX = 8

# The flat per-position acceptance (probability, 0..1) assumed for a request with no estimate at all. 0.5 is the
# uninformative middle; the scheduler normally passes profiles that already blend in the traffic's estimate.
DEFAULT_PRIOR_ALPHA = 0.5

# --- calibration -------------------------------------------------------------------------------------------------
# Batch sizes (rows) at which calibrate_cost_model times target and draft forwards. Powers of two up to 16 cover
# the scheduler's usual slot counts; sizes between them are interpolated, beyond 16 extrapolated.
CALIBRATION_BATCH_SIZES = (1, 2, 4, 8, 16)

# --- live correction of the cost model (CostModel.observe) -------------------------------------------------------
# Weight (0..1) of one measured step's log error in its batch size's factor F_b. High (0.5: F_b is about the mean
# of the latest two steps) because a shared host's speed moves 20-40% within seconds: a lagging factor leaves that
# drift to the running shape's own deviation, which then prices the width that happened to run during a slow
# stretch above the others, and the policy leaves it for a worse one.
DEFAULT_LIVE_RATE = 0.5

# Per-visit decay (0..1] of a shape's visit count n: a shape run often is priced by the mean of its ~30 latest
# steps (1 / (1 - 0.97)), long enough to average step jitter, short enough to follow a change of regime.
DEFAULT_CELL_DECAY = 0.97

# Pseudo-visits (> 0) shrinking a shape's deviation towards 0: a first visit moves it 1 / (1 + 3), a quarter of the
# way. At 1, one slow first visit could price a shape far above its neighbours, and a shape priced out is not run
# again to be corrected.
DEFAULT_CELL_PRIOR = 3.0

# Per step at a batch size, the factor (0..1] by which the *other* shapes' recent-visit counts u age. u only sets
# the probes' optimism, so a shape not run lately regains it and is retried; 0.99 halves u in ~70 steps.
DEFAULT_CELL_STALE = 0.99

# The most one measured step moves a price, in natural log (0.25: a 4x burst counts as 1.28x). Interference on a
# shared core makes single steps 4-10x slow; one such step must not price a shape out of use.
MAX_STEP_ERROR = 0.25

# --- the adaptive choice (AdaptivePolicy) ------------------------------------------------------------------------
# Hysteresis, a fraction of the best predicted goodput: the width that ran last stays while its best plan is within
# 3% of the best plan. The optimum is flat and the predictions noisy, so a plain argmax flips widths on noise;
# holding the incumbent costs at most this fraction by the model's own account.
DEFAULT_MARGIN = 0.03

# Decisions between probes (0 = never): one decision in 16 runs the other width of best optimistic goodput, so a
# width the model over-prices is run and corrected. A probe costs at most ~30% of one step in 16 (< 2%).
DEFAULT_PROBE_EVERY = 16

# A probed width's optimistic goodput must be within this fraction (10%) of the best plan's: probes explore near
# the optimum, not plans the model is sure are bad.
DEFAULT_PROBE_MARGIN = 0.10

# Log optimism given a (batch, tokens) shape seen u times: goodput x exp(0.25 / sqrt(u + 1)), so an unvisited shape
# 1.28x, after 3 visits 1.13x, after 30 1.05x (UCB-style: optimism fades as a shape's price is learnt).
DEFAULT_PROBE_BONUS = 0.25

# Per-step decay of the token factor's sums (realized / predicted accepted drafts): the ~100 latest steps
# (1 / (1 - 0.99)), enough steps for a stable ratio of a few tokens each.
TOKEN_DECAY = 0.99

# Pseudo-steps (at ratio 1) shrinking the token factor: the first few steps cannot swing it.
TOKEN_PRIOR = 4.0

# Bounds of the token factor (ratio): it corrects a bias of the estimates of a few percent (lookup evidence leans
# to rejections); the bounds keep a run of unusual steps from scaling every plan's tokens by more.
TOKEN_FACTOR_RANGE = (0.7, 1.4)
