"""The launcher of a multi-node run, `python -m inference.engine.launch TORCHRUN_ARGS` (run.sh generate uses
it when NODES > 1): every node first arrives at node 0's MASTER_ADDR:MASTER_PORT, and only then does torchrun
start, reusing node 0's store for its static rendezvous (no second port). A node missing after the rendezvous
timeout (--rdzv-conf timeout=S, run.sh's JOIN_TIMEOUT) is named in one line, with its ranks and the address
waited on; without this, node 0 waits in silence and ends with a traceback."""
import sys
import time
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

from ..parallel import DistributedError, arrive, first_line, reachable, span


def join_nodes(node: int, nodes: int, per_node: Optional[int], addr: str, port: int,
               timeout_s: float) -> dist.Store:
    """Every node of a multi-node launch arrives at node 0's addr:port within `timeout_s`, else a
    DistributedError names the nodes (and their ranks) missing and the address. Node 0 hosts the store as a
    multi-tenant server that torchrun's static rendezvous, started next in the same process, reuses: no
    second port. Keep the returned store until torchrun has ended."""
    where, deadline = f"{addr}:{port}", time.monotonic() + timeout_s

    def names(missing: List[int]) -> str:
        ranks = [r for n in missing for r in range(n * per_node, (n + 1) * per_node)] if per_node else []
        return span("node", missing) + (f" ({span('rank', ranks)})" if ranks else "")

    if node > 0 and not reachable(addr, port, deadline):
        raise DistributedError(f"node {node} found no node 0 at {where} within {timeout_s:g} s (start node 0 "
                               f"with NODE_RANK=0; check MASTER_ADDR, MASTER_PORT and the firewall)")
    try:
        store = dist.TCPStore(addr, port, None, node == 0, timedelta(seconds=timeout_s),
                              wait_for_workers=False, multi_tenant=node == 0)
    except dist.DistError as e:     # node 0: the port is taken
        raise DistributedError(f"node {node}: no rendezvous at {where}: {first_line(e)}") from None
    print(f"node {node} of {nodes}: waiting up to {timeout_s:g} s on {where} for the other nodes", flush=True)
    try:
        missing = arrive(dist.PrefixStore("inference/nodes", store), node, nodes, deadline, node == 0)
    except dist.DistError as e:
        raise DistributedError(f"node {node} lost node 0 at {where}: {first_line(e)}") from None
    if missing:
        raise DistributedError(f"{names(missing)} did not join within {timeout_s:g} s: node {node} waited on "
                               f"{where} (start run.sh generate with NODE_RANK={','.join(map(str, missing))} "
                               f"and the same MP, NODES, MASTER_ADDR, MASTER_PORT; JOIN_TIMEOUT)")
    return store


def launch(argv: List[str]) -> int:
    """torchrun TORCHRUN_ARGS, once every node has arrived at --master-addr:--master-port within the
    rendezvous timeout (--rdzv-conf timeout=S, by default torchrun's 600 s); else one line naming the nodes
    missing, exit status 1."""
    from torch.distributed import run as torchrun
    args = torchrun.parse_args(argv)
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    store, nodes, per_node = None, str(args.nnodes), str(args.nproc_per_node)
    try:
        if not nodes.isdigit():
            raise DistributedError(f"--nnodes must be a number of nodes here, got {nodes}")
        timeout_s = float(conf.get("timeout", 600))
        if int(nodes) > 1:
            store = join_nodes(args.node_rank, int(nodes), int(per_node) if per_node.isdigit() else None,
                               args.master_addr, args.master_port, timeout_s)
    except (ValueError, DistributedError) as e:     # a bad timeout; a node missing
        print(f"run.sh: error: {e}", file=sys.stderr, flush=True)
        return 1
    torchrun.main(argv)
    del store                                   # node 0: the store lives as long as torchrun's agent
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
