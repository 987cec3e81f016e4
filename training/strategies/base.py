"""The interface between the runner (which owns the loop) and a strategy (which owns
how the model, its gradients and its batch are spread over the world).

The runner calls, in order:
    s = Strategy(ctx, spec)              # ctx: training.context.RunContext; spec: conf Training,
                                         # whose `strategy` is this strategy's own block (s.config)
    s.setup(model, make_optimizer, example_input, resumed)   # make_optimizer(params) -> torch.optim.Optimizer;
                                         # example_input: a few rows of the data (or None);
                                         # resumed: this rank's state in the checkpoint loaded next
    lo, hi = s.batch_slice(global_batch) # rows of each global batch this rank must read
    stats = s.train_step(x, y)           # x, y: this rank's rows (or None where the strategy
                                         # broadcasts from rank 0); returns a StepStats
    s.scalars()                          # rank 0, every log_every steps: its own TensorBoard scalars
    loss_sum, correct, n = s.eval_step(x, y)   # summed over this rank's rows; runner reduces
    s.state_dict() / s.load_state_dict(d)      # this rank's part, for checkpoints (loaded after setup)
    s.model_for_export()                 # the full model on rank 0, at the end
    s.close()                            # hooks, threads, communicators released

A strategy counts its own work in training.cputime (the model's forward + backward,
its conv shares, the optimizer; the collectives count their waits), and
`own_cpu_s` says which of a step's CPU is the strategy's own (its hooks, copies,
protocol, MPI calls): what the planner's strategy probe reads to predict its cost
(training.strategies.<name>.cost).
"""
import abc
import dataclasses

from conf.errors import YarnappError


class StrategyError(YarnappError, ValueError):
    """A strategy that cannot run the job's model as configured: one line naming the field
    (the rank reports it without a traceback; every attempt would meet it, so it is not
    retried: launcher.retries)."""
    certain = True


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
        self.device = ctx.device         # training.devices: cuda:0 on a rank with GPUs, else cpu

    def given_shares(self):
        """One weight per rank from training.shares (training.data.order.given_weights), or
        None where the ranks measure them (speed)."""
        from training.data.order import given_weights
        try:
            return given_weights(self.spec.shares, [r.vcores for r in self.ctx.ranks])
        except ValueError as e:
            raise StrategyError(str(e)) from None

    @abc.abstractmethod
    def setup(self, model, make_optimizer, example_input=None, resumed=None):
        """Take the model (built alike on every rank from the same seed) and build the
        optimizer(s) over what this rank owns. example_input: a batch of inputs of the
        job's data, for whatever the strategy measures at setup (None: it makes its own
        from model.input_shape, or waits for the first step's batch). resumed: this rank's
        state_dict() in the checkpoint that load_state_dict loads next (None on every rank
        where the run starts afresh): a strategy that measures its split at setup takes
        the one that checkpoint's run measured instead, not measuring again."""

    @abc.abstractmethod
    def batch_slice(self, global_batch):
        """(lo, hi): the rows of a global batch of `global_batch` rows this rank reads."""

    @abc.abstractmethod
    def train_step(self, x, y):
        """One optimisation step on the global batch; returns StepStats."""

    @abc.abstractmethod
    def eval_step(self, x, y):
        """(loss_sum, correct, n) over the rows this rank was given (runner reduces)."""

    def before_eval(self):
        """Called on every rank before an evaluation's eval_steps (a collective where the
        strategy needs one)."""

    @abc.abstractmethod
    def state_dict(self):
        ...

    @abc.abstractmethod
    def load_state_dict(self, state):
        ...

    def model_for_export(self):
        """The full trained model on rank 0 (None elsewhere), for saving at the end."""
        return None

    def scalars(self):
        """{TensorBoard tag: value} of this strategy's own state, logged by rank 0 beside
        the runner's timings: here, where the strategy splits the batch by share weights
        (`self.weights`: the data-parallel ones), each rank's rows of a global batch and its
        weight (`shares/rows/rankN`, `shares/weight/rankN`: measured speeds for shares:
        speed); the model-parallel strategies give each rank's share of the model."""
        weights = getattr(self, "weights", None)
        if not weights:
            return {}
        from training.data.order import split_rows
        rows = split_rows(self.spec.batch_size, weights)
        return {**{f"shares/rows/rank{r}": n for r, n in enumerate(rows)},
                **{f"shares/weight/rank{r}": float(w) for r, w in enumerate(weights)}}

    def own_cpu_s(self, step_cpu_s, counted):
        """The CPU seconds of a step that were the strategy's own, from the step's CPU time
        `step_cpu_s` and training.cputime's `counted` seconds of it: all but the model's
        forward + backward, the conv shares, the optimizer and the waits, which the
        planner times (or models) itself."""
        return step_cpu_s - counted["model"] - counted["share"] - counted["optimizer"] - counted["wait"]

    def close(self):
        """Release what the strategy holds beyond the model (hooks, threads, communicators)."""
