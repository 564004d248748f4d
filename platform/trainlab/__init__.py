"""trainlab: a validated experiment config in; prepared data, a fault-tolerant
Ray Train run and a comparable MLflow record out.

Only light imports here: `trainlab validate/show/plan` must not pull in Ray or torch.
"""

__version__ = "0.1.0"
