"""What a YARN cluster's running nodes can hold, checked before a job is packed and
submitted (yarnapp.backends.yarn): YARN took a container larger than every node, or one
asking for a node label no node has, and failed it with a Java stack trace as the error;
and it left containers more than all nodes hold together waiting until the rendezvous
timed out."""
import logging

import skein

from ..errors import YarnappError

log = logging.getLogger(__name__)


def check_fits(get_nodes, job, where, tensorboard, child_queues=None, counts_vcores=True):
    """Refuse in one line a container larger than every running node it may use (a labelled
    group: the nodes of its label; others: the unlabelled), a label no node has, or
    containers (with skein's master and, where the job runs it, the TensorBoard service of
    `tensorboard` resources) more than all running nodes hold together, or more memory
    than its queue may ever hold (its maximum capacity of the cluster). get_nodes: skein's
    Client.get_nodes; child_queues: its get_child_queues; counts_vcores: whether the
    scheduler counts vcores (the capacity scheduler's DefaultResourceCalculator counts
    memory alone, and runs a job that asks for more vcores than the nodes have). What is not
    read is left to YARN."""
    try:
        reports = get_nodes(states=["RUNNING"])
    except Exception as e:  # noqa: BLE001 - an older ResourceManager, ACLs: YARN's to say
        log.debug("the cluster's nodes not read: %s", e)
        return
    if not reports:
        return
    pre = f"{where}: " if where else ""
    labels = sorted({label for n in reports for label in (n.labels or ())})
    for i, g in enumerate(job.groups):
        usable = [n.total_resources for n in reports if (g.node_label in (n.labels or ()) if g.node_label
                                                          else not n.labels)]
        if g.node_label and not usable:
            raise YarnappError(f"{pre}groups[{i}].node_label: no running node of this cluster has the label "
                               f"{g.node_label!r} (its labels: {', '.join(labels) or 'none'}); give one of "
                               f"those, or drop it")
        vcores, memory = max((n.vcores for n in usable), default=0), max((n.memory for n in usable), default=0)
        if usable and (g.vcores > vcores or g.memory > memory):
            raise YarnappError(f"{pre}groups[{i}]: a container of group {g.name!r} asks for {g.vcores:g} vcores "
                               f"and {g.memory} MiB, more than any node it may use has (the largest: "
                               f"{vcores} vcores, {memory} MiB); ask for less, or use more containers")
    master = skein.Master().resources
    wanted = [(g.vcores, g.memory, g.instances) for g in job.groups] + [(master.vcores, master.memory, 1)]
    if job.tensorboard.service:
        wanted.append((tensorboard["vcores"], tensorboard["memory"], 1))
    need_v, need_m = int(sum(v * n for v, _, n in wanted)), sum(m * n for _, m, n in wanted)
    have_v = sum(n.total_resources.vcores for n in reports)
    have_m = sum(n.total_resources.memory for n in reports)
    if (need_v > have_v and counts_vcores) or need_m > have_m:
        raise YarnappError(f"{pre}groups: the job's containers, with skein's master"
                           f"{' and the TensorBoard service' if job.tensorboard.service else ''}, ask for "
                           f"{need_v} vcores and {need_m} MiB in all, more than this cluster's {len(reports)} "
                           f"running node(s) have together ({have_v} vcores, {have_m} MiB): the world could "
                           f"never form; ask for fewer instances, vcores or memory")
    # The queue's maximum capacity, of the default partition (a node label's capacities are
    # set apart: its groups are left to YARN): the unlabelled groups, the master and the
    # TensorBoard service against the unlabelled nodes.
    share = queue_share(child_queues, job.queue) if child_queues else None
    plain = [(g.memory, g.instances) for g in job.groups if not g.node_label] + \
        [(m, n) for _, m, n in wanted[len(job.groups):]]
    plain_m = sum(m * n for m, n in plain)
    nodes_m = sum(n.total_resources.memory for n in reports if not n.labels)
    if share is not None and nodes_m and plain_m > nodes_m * share:
        raise YarnappError(f"{pre}queue: the job's containers, with skein's master"
                           f"{' and the TensorBoard service' if job.tensorboard.service else ''}, ask for {plain_m} "
                           f"MiB in all, more than queue {job.queue!r} may ever hold (its maximum capacity, "
                           f"{share:.0%} of the cluster's {nodes_m} MiB: {int(nodes_m * share)} MiB): the world "
                           f"could never form; ask for less, or submit to another queue")


def queue_share(child_queues, name):
    """The part of the cluster a queue may ever use (the product of its and its parents'
    maximum capacities, from root), or None where it is not found."""
    todo = [(q, 1.0) for q in _children(child_queues, "root")]
    while todo:
        q, above = todo.pop()
        share = above * q.max_capacity / 100.0
        if q.name == name.rsplit(".", 1)[-1]:       # (leaf names are unique: "a" or "root.x.a")
            return share
        todo.extend((c, share) for c in _children(child_queues, q.name))
    return None


def _children(child_queues, name):
    try:
        return child_queues(name)
    except Exception as e:  # noqa: BLE001 - a leaf (YARN answers with an error), an ACL: not read
        log.debug("the children of queue %s not read: %s", name, e)
        return []

