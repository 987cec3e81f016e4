"""Hypergraph-partitioned model parallelism (Eserol 2019): the model as a hypergraph,
its partition, and the communication volume and balance of every way to split it.

The layer chain. A model is traced with torch.fx into a chain of *unit layers*
(nn.Conv2d: one unit per output channel; nn.Linear: one unit per neuron; and a last
pseudo-layer, the loss, of one unit) joined by parameter-free ops. The ops after a
unit layer that act on each channel alone (element-wise activations, pooling) are
*owner-side*: the rank that computes a channel also applies them to it, so what
leaves the rank is the pooled map. Everything from the first op that mixes channels
(a flatten, a reshape) up to the next unit layer is *consumer-side*: every rank that
computes units of the next layer applies it to the assembled input. The model's
input is read by every rank from the data (it is never sent).

The hypergraph H = (V, N):
    vertices   v = (layer l, unit u), weight w(v) = FLOPs of one sample, forward and
               backward: conv  2·Ho·Wo·(Cin/groups)·kh·kw · (3, or 2 for the first layer,
               which needs no dX); linear 2·in_features · (3 or 2); loss 5·classes.
    nets       n(v) = {v} ∪ consumers(v): the units of layer l+1 that read v's
               activation (every unit for a dense conv or a linear layer; the units of
               v's group for a grouped conv); cost c(n) = bytes of v's activation for
               one sample after its owner-side ops (element size × Ho'·Wo').

A partition Π: V → {0..K−1} onto ranks of capacities s_r (relative speed) costs
    forward volume      Σ_n (λ(n) − 1)·c(n)     λ(n) = |{Π(v) : v ∈ n}|, bytes per sample
                        (the producer sends its activation once to each other part);
    backward volume     the same: each consuming part returns its partial gradient
                        ∂L/∂a_v (a sum over its own units) to the producer's part;
    volume per sample   V = 2 Σ_n (λ(n) − 1)·c(n)   (the connectivity − 1 metric, ×2);
    imbalance           max_r W_r / T_r − 1,   W_r = Σ_{Π(v)=r} w(v),  T_r = W·s_r/Σ s.
The partition minimises V subject to W_r ≤ (1 + ε)·T_r, computed by Mt-KaHyPar (a
multilevel hypergraph partitioner, objective km1 = connectivity − 1, individual
maximum block weights). It optimises the *total* load per rank, as the thesis does
for pipelined execution; a layer-synchronous execution waits, layer by layer, for the
rank with the most units of that layer.

Compared with (all on the same hypergraph and volume formula):
    conv-layer split   every conv's channels split in proportion to s_r (contiguous
                       ranges, training.strategies.conv_mp.calibrate.proportional_split), every linear
                       layer and the loss on rank 0 (the master), as in
                       training.strategies.conv_mp;
    layer-wise split   contiguous runs of whole layers (a pipeline), one run per rank,
                       the cut points and rank order minimising max_r W_r / T_r (ties:
                       least volume);
    data parallelism   every rank holds all |W| parameter bytes; ring all-reduce sends
                       2(K−1)/K·|W| bytes per rank per step, 2(K−1)·|W| in all, i.e.
                       2(K−1)·|W|/B per sample at a global batch of B rows; the batch is
                       split in proportion to s_r (imbalance from integer rows only).

`partition_report(model, input_shape, capacities, batch)` gives all four as rows (the
planner's entry point); `hypergraph_partition` the partition itself; `layer_chain` the
traced chain that training.strategies.hypergraph executes.

Modules: chain (tracing a model into the layer chain), hypergraph (H, its volume and
balance), kahypar (the partition by Mt-KaHyPar), compare (the other splits and the
report), networks (LeNet and VGG-11 for CIFAR, the comparison's benchmark networks).
"""
from .chain import LayerChain, Op, PartitionError, UnitLayer, layer_chain
from .compare import METHODS, conv_split_parts, data_parallel_row, partition_report, pipeline_parts
from .hypergraph import Hypergraph, build_hypergraph, connectivity, evaluate
from .kahypar import EPSILON, hypergraph_partition, integer_imbalance, max_block_weights
from .networks import BENCHMARK_NETWORKS, LeNetCIFAR, VGGCIFAR

__all__ = ["PartitionError", "Op", "UnitLayer", "LayerChain", "Hypergraph", "layer_chain",
           "build_hypergraph", "evaluate", "connectivity", "hypergraph_partition", "max_block_weights",
           "integer_imbalance", "conv_split_parts", "pipeline_parts", "data_parallel_row", "partition_report",
           "METHODS", "EPSILON", "LeNetCIFAR", "VGGCIFAR", "BENCHMARK_NETWORKS"]
