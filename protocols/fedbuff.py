"""FedBuff (Nguyen et al., AISTATS 2022): buffered asynchronous aggregation on a star; with --buffer 1,
FedAsync (Xie, Koyejo and Gupta, 2019).

The server is the node of highest degree (ties: the lowest id), adjacent to every other node
(--topology star, or mesh); it holds the global model x and its version v (the count of server
steps applied to it). It sends (x0, 0) to every client, then handles client messages as they arrive:

  client k, looping at its own pace until --duration:
    1. take the newest (x, v) the server sent; none for --timeout: ask the server again;
    2. run local SGD from x on its n_k samples (--local-steps, or --local-epochs), giving x_k;
    3. send (Δ_k = x_k - x, v, n_k); under --buffer 1, (x_k, v, n_k).
  server, on each update from k trained from version v_k (staleness s = v - v_k):
    --buffer K > 1 (FedBuff): Δ̄ <- Δ̄ + (1 + s)^-a Δ_k; once K updates are in,
        x <- x + eta_g Δ̄ / K, Δ̄ <- 0, v <- v + 1   (a: --staleness-exponent, eta_g: --server-lr)
    --buffer 1 (FedAsync): alpha_t = alpha (1 + s)^-a; x <- (1 - alpha_t) x + alpha_t x_k, v <- v + 1
        (alpha: --async-alpha)
    and answers k at once with the current (x, v); a request for the model is answered alike.
Each server step is one update received (its row logs staleness, staleness_weight, applied, version);
each client step is one local round (train_loss). Only floating-point tensors are sent and combined.
Under --dp each client trains with DP-SGD and its own accountant: its epsilon grows with its own trainings.
The server holds no data: the partition has one part per client. Under --test-set global the server's x
is what --eval-every-seconds scores and the final test_acc; under --test-set local each client's own model
is, on its own test split. Nothing is scored during the run otherwise (it would be charged compute).

Departures from the papers. FedBuff's authors released no code; Meta's FLSim (facebookresearch/FLSim)
has a buffered aggregator (HybridAggregator) with a polynomial staleness weight, the closest public one.
Nor did FedAsync's; Plato's FedAsync strategy (TL-System/plato) mixes as above and was the comparison.
- every client trains all the time (concurrency = the number of clients): no client sampling and no cap
  on concurrent clients as in FedBuff's experiments, FedAsync's scheduler or Plato;
- local training is plain SGD: FedAsync's workers add a proximal term rho/2 ||x_k - x||^2 (rho = 0 here);
- the server's optimiser is plain SGD on the mean delta (FedBuff also tries server momentum);
- the staleness weight is (1 + s)^-a only: not normalised to 1 at an average staleness as FLSim's is,
  and FedAsync's hinge function is not offered; a = 1/2 by default, FedBuff's choice;
- the buffered deltas have equal weights, as in FedBuff's algorithm box (FLSim can weight them by
  sample counts): n_k is sent and checked, but does not weight the mean;
- the papers assume reliable channels: here a client that hears nothing for --timeout asks again, so a
  lost message or an offline node never stalls it; a buffer partly filled at the horizon is not applied,
  and updates arriving after it are dropped (the server has stopped);
- FedAsync's scheduler, updater and worker threads are the server's loop and the clients' loops: an
  update is mixed in as it arrives and answered at once with the new model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from emulator.errors import UsageError
from emulator.protocol import register
from p2p_emulator.workloads.training import float_state, load_state, mix

from .common import (STATE, SGDOptions, TimeoutOptions, check, default, expects,
                     positive_int, test_scores)
from .fedavg import ServerAndClients

DELTA = "delta"  # x_k - x: what a FedBuff client sends


@dataclass
class FedBuffOptions(TimeoutOptions, SGDOptions):
    momentum: float = default(SGDOptions, "momentum", 0.0)
    weight_decay: float = default(SGDOptions, "weight_decay", 0.0)
    timeout: float = field(default=10.0, metadata={
        "help": "fedbuff: emulated seconds a client waits for the server's model before asking for it again"})
    buffer: int = field(default=3, metadata={
        "help": "fedbuff: client updates the server buffers per step of the global model, K "
                "(1: FedAsync, each update mixed in as it arrives)"})
    server_lr: float = field(default=1.0, metadata={
        "help": "fedbuff: the server's learning rate eta_g on the mean buffered delta (--buffer > 1)"})
    async_alpha: float = field(default=0.6, metadata={
        "help": "fedbuff --buffer 1 (FedAsync): mixing weight alpha in (0, 1] of a fresh update"})
    staleness_exponent: float = field(default=0.5, metadata={
        "help": "fedbuff: an update s server steps stale is weighted (1 + s)^-a, a this exponent "
                "(0: no down-weighting)"})

    def validate(self):
        super().validate()
        check("buffer", self.buffer, self.buffer >= 1, "must be at least 1 (1: FedAsync)")
        check("server-lr", self.server_lr, math.isfinite(self.server_lr) and self.server_lr > 0, "must be positive")
        check("async-alpha", self.async_alpha, 0 < self.async_alpha <= 1, "must be in (0, 1]")
        check("staleness-exponent", self.staleness_exponent,
              math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0, "must not be negative")
        if self.init != "common":
            raise UsageError(f"--init {self.init}: fedbuff has one global model; use --init common")


def staleness_weight(staleness: int, exponent: float) -> float:
    """(1 + s)^-a: the weight of an update computed on a model `staleness` server steps old."""
    return (1.0 + staleness) ** -exponent


def mixing_weight(alpha: float, staleness: int, exponent: float) -> float:
    """FedAsync's alpha_t = alpha (1 + s)^-a."""
    return alpha * staleness_weight(staleness, exponent)


# -- jobs (module level: a job must be importable)

def zeros_like_state(module) -> dict:
    """Δ̄ = 0, shaped like the module's floating-point state."""
    return {name: value.detach().new_zeros(value.shape) for name, value in float_state(module).items()}


def delta_from(module, received: dict) -> dict:
    """Δ = x_k - x: the module's floating-point state minus the model it was loaded from."""
    state = module.state_dict()
    return {name: state[name].detach() - value.to(state[name].device, state[name].dtype)
            for name, value in received.items()}


def accumulate(total: dict, delta: dict, weight: float) -> None:
    """Δ̄ <- Δ̄ + weight Δ, in place."""
    for name, value in total.items():
        value.add_(delta[name].to(value.device, value.dtype), alpha=weight)


def apply_buffer(module, total: dict, scale: float) -> None:
    """x <- x + scale Δ̄, then Δ̄ <- 0, in place."""
    mix(module, 1.0, [(scale, total)])
    for value in total.values():
        value.zero_()


@dataclass
class Server:
    """The server's global model, its version and its buffer."""
    model: object
    version: int = 0
    buffered: int = 0
    total: object = None  # Δ̄, kept where the server's jobs run (--buffer > 1)


@register("fedbuff")
class FedBuff(ServerAndClients):
    """FedBuff: clients train at their own pace; the server applies every K updates (K = 1: FedAsync)."""
    Options = FedBuffOptions
    asynchronous = True

    def __init__(self, options, run_info):
        super().__init__(options, run_info)
        self.horizon = run_info.duration or math.inf

    # -- the server

    async def _serve(self, node):
        o = self.options
        initial = self.workload.model(0)  # the common start x0, version 0
        server = Server(node.keep(initial))
        test = self._global_test(node, initial) if self.workload.test_set == "global" else None
        if test is not None:
            node.score_with(test_scores, server.model, test.test_x, test.test_y)
        if o.buffer > 1:
            server.total = await node.compute(zeros_like_state, server.model, work=0, keep=True)
        example = await self.state(node, server.model)
        node.broadcast("model", {STATE: example, "version": 0}, to=self.clients)
        # from the server's version: an update trained on a model it has not sent yet is refused
        version = lambda v: type(v) is int and 0 <= v <= server.version  # noqa: E731
        update = expects(**{DELTA if o.buffer > 1 else STATE: example, "version": version, "samples": positive_int})
        request = expects(version=int)
        valid = lambda body: update(body) or request(body)  # noqa: E731
        async for _ in node.rounds():
            while (message := await self._next(node, valid)) is not None and "samples" not in message.body:
                await self._answer(node, server, message.src)  # a client asking for the model again
            if message is not None:
                await self._apply(node, server, message)
                await self._answer(node, server, message.src)
        if test is not None:
            await self.log_final_scores(node, server.model, test)

    async def _next(self, node, valid):
        """The next update or request; None once the horizon has passed without one."""
        wait = self.horizon - node.now()
        return await node.recv(timeout=wait, valid=valid) if wait > 0 else None

    async def _apply(self, node, server: Server, message) -> None:
        """One update into the global model (FedAsync) or the buffer (FedBuff); logs this step's row."""
        o, body = self.options, message.body
        stale = server.version - body["version"]
        weight = staleness_weight(stale, o.staleness_exponent)
        if o.buffer == 1:
            alpha = o.async_alpha * weight
            await node.compute(mix, server.model, 1.0 - alpha, [(alpha, body[STATE])], work=0)
            server.version += 1
            node.log(staleness=stale, staleness_weight=weight, alpha=alpha, applied=1, version=server.version)
            return
        await node.compute(accumulate, server.total, body[DELTA], weight, work=0)
        server.buffered += 1
        applied = server.buffered == o.buffer
        if applied:
            await node.compute(apply_buffer, server.model, server.total, o.server_lr / o.buffer, work=0)
            server.version, server.buffered = server.version + 1, 0
        node.log(staleness=stale, staleness_weight=weight, applied=int(applied), version=server.version)

    async def _answer(self, node, server: Server, client: int) -> None:
        if client in node.neighbours:
            node.send(client, "model", {STATE: await self.state(node, server.model), "version": server.version})

    # -- a client

    async def _client(self, node):
        o = self.options
        # under --test-set global the server's model is what the sampler scores
        model, data = self.hold(node, self.part[node.id], scored=self.workload.test_set == "local")
        example = await self.state(node, model)
        valid = expects(**{STATE: example, "version": int})
        samples = len(data.train_y)
        message = await self._newest_model(node, valid, -1)  # x0
        trained = False
        # None only at the horizon, where node.rounds() ends
        async for _ in node.rounds():
            received, version = message.body[STATE], message.body["version"]
            await node.compute(load_state, model, received, work=0)  # 1
            loss = await self.train(node, model, data)  # 2
            if o.buffer > 1:
                update = {DELTA: await node.compute(delta_from, model, received, work=0)}
            else:
                update = {STATE: await self.state(node, model)}
            if self.server in node.neighbours:
                node.send(self.server, "update", {**update, "version": version, "samples": samples})  # 3
            node.log(train_loss=loss, model_version=version)
            trained = True
            message = await self._newest_model(node, valid, version)
        if trained and self.workload.test_set == "local":
            await self.log_final_scores(node, model, data)

    async def _newest_model(self, node, valid, version: int):
        """The newest model the server has sent, not older than `version`; after each --timeout without one,
        a request for it; None once the horizon has passed."""
        while (wait := min(self.options.timeout, self.horizon - node.now())) > 0:
            message = await node.recv(timeout=wait, kind="model", valid=valid)
            if message is None:  # silence: the update, its answer or the last request was lost, or a node is down
                if node.now() < self.horizon and self.server in node.neighbours:
                    node.send(self.server, "request", {"version": version})
                continue
            newest = None
            while message is not None:  # the newest of those here (answers to an update and to a request)
                if message.body["version"] >= version and (newest is None
                                                           or message.body["version"] >= newest.body["version"]):
                    newest = message
                message = await node.recv(timeout=0, kind="model", valid=valid)
            if newest is not None:
                return newest
        return None

    def summary(self, records):
        return {"server": self.server}
