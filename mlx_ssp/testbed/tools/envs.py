"""The tool testbed's four toy backends, each an environment under :mod:`mlx_ssp.agents.env`.

Each class is reset from a config dict, keeps its whole state in one public attribute (what the
checker compares), and has four tools with short names, short results (``"ok"``, a number, a name, a
short list) and short error messages. Deterministic: no randomness, no clock, no I/O.

**Interference by design**: the backends share tool names, argument shapes and entity names, so a
model trained on one backend has something to get wrong on another (read one, write one, remove or
change, list or find)::

    KeyValue   get(key)          put(key, value)           delete(key)                  keys()
    Counters   get(name)         add(name, amount=1)       clear(name)                  top()
    Files      cat(name)         write(name, text)         rm(name)                     ls()
    Bank       balance(account)  deposit(account, amount)  transfer(src, dst, amount)   richest()

``get`` is in two backends with different argument names; ``delete``/``rm``, ``put``/``write``,
``keys``/``ls``, ``add``/``deposit`` and ``top``/``richest`` mean nearly the same; keys, counter
names and file names are drawn from one word pool (:mod:`.episodes`).
"""

from __future__ import annotations

from typing import Any


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty string")
    return value


def _int(value: Any, what: str, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer")
    if positive and value <= 0:
        raise ValueError(f"{what} must be > 0")
    return value


class KeyValue:
    """A key-value store of short strings."""

    def reset(self, config: dict) -> None:
        self.data = {str(k): str(v) for k, v in config.get("data", {}).items()}

    def get(self, key: str) -> str:
        """The value stored under a key.

        Args:
            key: the key.
        """
        if _name(key, "key") not in self.data:
            raise LookupError(f"no key {key}")
        return self.data[key]

    def put(self, key: str, value: str) -> str:
        """Store a value under a key, replacing any old value.

        Args:
            key: the key.
            value: the value to store.
        """
        self.data[_name(key, "key")] = _name(value, "value")
        return "ok"

    def delete(self, key: str) -> str:
        """Delete a key and its value.

        Args:
            key: the key.
        """
        if _name(key, "key") not in self.data:
            raise LookupError(f"no key {key}")
        del self.data[key]
        return "ok"

    def keys(self) -> list:
        """Every key, sorted."""
        return sorted(self.data)


class Counters:
    """Named integer counters."""

    def reset(self, config: dict) -> None:
        self.counts = {str(k): int(v) for k, v in config.get("counts", {}).items()}

    def get(self, name: str) -> int:
        """A counter's value.

        Args:
            name: the counter.
        """
        if _name(name, "name") not in self.counts:
            raise LookupError(f"no counter {name}")
        return self.counts[name]

    def add(self, name: str, amount: int = 1) -> int:
        """Add to a counter (a new counter starts at 0); returns its new value.

        Args:
            name: the counter.
            amount: how much to add.
        """
        self.counts[_name(name, "name")] = self.counts.get(name, 0) + _int(amount, "amount")
        return self.counts[name]

    def clear(self, name: str) -> str:
        """Set a counter back to 0.

        Args:
            name: the counter.
        """
        if _name(name, "name") not in self.counts:
            raise LookupError(f"no counter {name}")
        self.counts[name] = 0
        return "ok"

    def top(self) -> str:
        """The name of the highest counter (ties: the first by name)."""
        if not self.counts:
            raise LookupError("no counters")
        return min(self.counts, key=lambda n: (-self.counts[n], n))


class Files:
    """A flat folder of small text files."""

    def reset(self, config: dict) -> None:
        self.files = {str(k): str(v) for k, v in config.get("files", {}).items()}

    def ls(self) -> list:
        """Every file name, sorted."""
        return sorted(self.files)

    def cat(self, name: str) -> str:
        """A file's text.

        Args:
            name: the file.
        """
        if _name(name, "name") not in self.files:
            raise LookupError(f"no file {name}")
        return self.files[name]

    def write(self, name: str, text: str) -> str:
        """Write a file, replacing any old text.

        Args:
            name: the file.
            text: its new text.
        """
        if not isinstance(text, str):
            raise TypeError("text must be a string")
        self.files[_name(name, "name")] = text
        return "ok"

    def rm(self, name: str) -> str:
        """Remove a file.

        Args:
            name: the file.
        """
        if _name(name, "name") not in self.files:
            raise LookupError(f"no file {name}")
        del self.files[name]
        return "ok"


class Bank:
    """Bank accounts holding whole amounts."""

    def reset(self, config: dict) -> None:
        self.accounts = {str(k): int(v) for k, v in config.get("accounts", {}).items()}

    def _account(self, account: Any) -> str:
        if _name(account, "account") not in self.accounts:
            raise LookupError(f"no account {account}")
        return account

    def balance(self, account: str) -> int:
        """An account's balance.

        Args:
            account: the account's owner.
        """
        return self.accounts[self._account(account)]

    def deposit(self, account: str, amount: int) -> int:
        """Pay money into an account; returns the new balance.

        Args:
            account: the account's owner.
            amount: how much, > 0.
        """
        self.accounts[self._account(account)] += _int(amount, "amount", positive=True)
        return self.accounts[account]

    def transfer(self, src: str, dst: str, amount: int) -> dict:
        """Move money from one account to another; returns both new balances.

        Args:
            src: the paying account.
            dst: the receiving account.
            amount: how much, > 0.
        """
        self._account(src), self._account(dst), _int(amount, "amount", positive=True)
        if src == dst:
            raise ValueError("src and dst are the same account")
        if self.accounts[src] < amount:
            raise ValueError(f"{src} has only {self.accounts[src]}")
        self.accounts[src] -= amount
        self.accounts[dst] += amount
        return {src: self.accounts[src], dst: self.accounts[dst]}

    def richest(self) -> str:
        """The owner of the account with the most money (ties: the first by name)."""
        if not self.accounts:
            raise LookupError("no accounts")
        return min(self.accounts, key=lambda n: (-self.accounts[n], n))


#: backend short name (the episodes' domain) -> class
CLASSES: dict[str, type] = {"kv": KeyValue, "ctr": Counters, "files": Files, "bank": Bank}
