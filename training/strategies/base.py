"""The interface between the runner (which owns the loop) and a strategy (which owns
how the model, its gradients and its batch are spread over the world).

The runner calls, in order:
    s = Strategy(ctx, spec)              # ctx: training.context.RunContext; spec: conf Training
    s.setup(model, make_optimizer)       # make_optimizer(params) -> torch.optim.Optimizer
    lo, hi = s.batch_slice(global_batch) # rows of each global batch this rank must read
    stats = s.train_step(x, y)           # x, y: this rank's rows (or None where the strategy
                                         # broadcasts from rank 0); returns a StepStats
    loss_sum, correct, n = s.eval_step(x, y)   # summed over this rank's rows; runner reduces
    s.state_dict() / s.load_state_dict(d)      # this rank's part, for checkpoints
"""
import abc
import dataclasses


@dataclasses.dataclass
class StepStats:
    loss: float          # mean loss of the global batch (same value on every rank)
    correct: int         # correct predictions in the global batch
    samples: int         # global batch size
    compute_s: float     # time in forward/backward/optimizer on this rank
    comm_s: float        # time blocked in communication on this rank


class Strategy(abc.ABC):
    name = "base"

    def __init__(self, ctx, spec):
        self.ctx = ctx
        self.spec = spec
        self.config = spec.strategy      # this strategy's own fields (conf.schema StrategyConfig)
        self.comm = ctx.comm
        self.rank = ctx.rank
        self.world_size = ctx.world_size

    @abc.abstractmethod
    def setup(self, model, make_optimizer):
        ...

    @abc.abstractmethod
    def batch_slice(self, global_batch):
        """(lo, hi): the rows of a global batch of `global_batch` rows this rank reads."""

    @abc.abstractmethod
    def train_step(self, x, y):
        """One optimisation step on the global batch; returns StepStats."""

    @abc.abstractmethod
    def eval_step(self, x, y):
        """(loss_sum, correct, n) over the rows this rank was given (runner reduces)."""

    @abc.abstractmethod
    def state_dict(self):
        ...

    @abc.abstractmethod
    def load_state_dict(self, state):
        ...

    def model_for_export(self):
        """The full trained model on rank 0 (None elsewhere), for saving at the end."""
        return None
