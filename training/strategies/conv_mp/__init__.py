"""Conv-layer model parallelism (Marques et al. 2018):

    strategy.py   the strategy: which convs, the split, steps, recalibration, checkpoints
    layers.py     DistributedConv2d: a conv whose kernels are split over the ranks
    comm.py       its communication, in autograd pairs (Bcast ↔ Reduce, Gatherv ↔ Scatterv)
    protocol.py   ShardProtocol: the master runs the network, the others serve their shards
    calibrate.py  measured speeds and speed-proportional splits
    cost.py       the cost model (the planner's prediction) and seed 1's bound
"""
