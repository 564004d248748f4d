"""Mixture laws: find a data mix from a swarm of small proxy runs.

The loop (RegMix, Data Mixing Laws, Olmix), end to end on a Ray cluster:

1. `sampling`: mixtures from a Dirichlet centred on the sources' natural token
   shares, plus the uniform mix and a few near-corners; each one must respect
   `data.max_epochs_per_source` at the proxy's token budget (rejected otherwise).
2. `swarm`: one Ray Tune trial per mixture, each an ordinary trainlab run of the
   proxy config (run directory, MLflow run nested under the swarm's parent run).
   The swarm record (`{runs_root}/mix/{swarm_id}/swarm.json`, `record`) keeps
   every trial's mix and held-out losses, and the cost (`cost`).
3. `fit`: regressions of a target (`targets`) on the weights, cross-validated.
4. `propose`: the fitted law optimised under bounds and the repetition caps of
   the *target* run's token budget; written as a recipe override.
5. `confirm`: the proposal and a baseline trained at the target config.

Mixing happens at read time, so a mixture is one number per source in the
config: every proxy reads the same prepared dataset.
"""
