"""Max flooding: every node learns the largest initial value, one hop per round.

Node i starts with a value drawn from its own stream. Each round it sends the
largest value it knows to its neighbours and keeps the largest of what arrives;
after as many rounds as the graph's diameter every node knows the global maximum.
"""
from dataclasses import dataclass, field

from p2p_emulator import Protocol, UsageError


@dataclass
class MaxFloodOptions:
    timeout: float = field(default=1.0, metadata={"help": "max-flood: emulated seconds to wait per round"})

    def validate(self):
        if not self.timeout > 0:
            raise UsageError(f"--timeout {self.timeout}: must be positive")


class MaxFlood(Protocol):
    """Max flooding: every node learns the largest initial value, one hop per round."""
    Options = MaxFloodOptions

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        self.largest = max(self.initial(i) for i in range(run_info.num_nodes))  # for the metric only

    def initial(self, node_id: int) -> float:
        return float(self.run_info.seeds.numpy("max-flood", node_id).random())

    async def run(self, node):
        known = self.initial(node.id)
        async for _ in node.rounds():
            node.broadcast("max", known)
            heard = await node.gather("max", timeout=self.options.timeout, valid=lambda body: isinstance(body, float))
            known = max([known, *(message.body for message in heard.values())])
            node.log(knows_max=float(known == self.largest))
