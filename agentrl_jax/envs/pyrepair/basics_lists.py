"""Basic problems on lists and dicts: loops, searching, counting, building (see ``basics``)."""

from agentrl_jax.envs.pyrepair.basics_entry import Basic, inputs


@inputs([1, 2, 3], [], [5], [-1, 1], [10, -20, 5], [0, 0, 7])
def sum_list(nums):
    """Return the sum of the numbers in nums (0 for an empty list)."""
    total = 0
    for x in nums:
        total += x
    return total


@inputs([1, 2, 3, 4], [], [5], [1, 2], [-1, 1], [2, 4, 6], [1, 2, 3, 4, 5, 6, 7, 8])
def average(nums):
    """Return the mean of the numbers in nums as a float, or 0.0 for an empty list."""
    if not nums:
        return 0.0
    return sum(nums) / len(nums)


@inputs([1, -2, 3], [0, 0], [], [-1, -5], [4, 5, 6], [0, 1, -1, 2])
def count_positives(nums):
    """Return how many numbers in nums are greater than zero."""
    count = 0
    for x in nums:
        if x > 0:
            count += 1
    return count


@inputs([1, 3, 2], [3, 1, 2], [1, 2, 3], [5], [-1, -5, -3], [2, 2], [0, -1])
def largest_number(nums):
    """Return the largest number in the non-empty list nums."""
    best = nums[0]
    for x in nums[1:]:
        if x > best:
            best = x
    return best


@inputs([2, 1, 1], [1, 2, 3], [3, 2, 1], [3, 1, 2], [5], [4, 4], [-1, -5, -5, 0])
def index_of_smallest(nums):
    """Return the position of the first smallest number in the non-empty list nums."""
    best = 0
    for i in range(1, len(nums)):
        if nums[i] < nums[best]:
            best = i
    return best


@inputs([1, 2, 3, 4], [], [1, 3], [0, -2, -3], [2, 2, 5], [7, 8, 10, 11])
def keep_even(nums):
    """Return the even numbers of nums, in order."""
    return [x for x in nums if x % 2 == 0]


@inputs([1, 2, 3], [], [0], [-4, 5], [10, 2], [7])
def double_all(nums):
    """Return a new list holding each number of nums multiplied by 2."""
    return [x * 2 for x in nums]


@inputs(([1, 2, 1], 1), ([], 3), (["a", "b"], "c"), ([2, 2, 2], 2), ([1, 2, 3], 3), ([0, 1], 0))
def count_occurrences(items, target):
    """Return how many elements of items are equal to target."""
    count = 0
    for x in items:
        if x == target:
            count += 1
    return count


@inputs(([1, 2, 1], 1), ([], 3), (["a", "b"], "c"), ([2, 2, 2], 2), ([1, 2, 3], 3), ([0, 1], 1))
def remove_value(items, value):
    """Return a new list of the elements of items that are not equal to value, in order."""
    return [x for x in items if x != value]


@inputs([1, 2, 3], [], [5], [1, -1, 1], [0, 0], [3, 4, 10])
def running_total(nums):
    """Return the list of running sums of nums ([1, 2, 3] -> [1, 3, 6])."""
    result = []
    total = 0
    for x in nums:
        total += x
        result.append(total)
    return result


@inputs([1, 2, 3], [], [7], ["a", "b"], [1, 1, 2], [4, 3, 2, 1])
def reverse_list(items):
    """Return a new list of the elements of items in reverse order."""
    result = []
    for x in items:
        result.insert(0, x)
    return result


@inputs([3, 3, 2], [4, 4], [1, 2, 3], [5], [], [-1, -2], [10, 20, 20, 5])
def second_largest(nums):
    """Return the second largest distinct number in nums, or None if there are fewer than two."""
    values = sorted(set(nums))
    if len(values) < 2:
        return None
    return values[-2]


@inputs(([1, 2, 3, 4, 5], 2), ([1, 2, 3, 4], 2), ([], 3), ([1], 1), ([1, 2, 3], 5), ([1, 2, 3], 3))
def chunk(items, size):
    """Return items cut into consecutive lists of size elements, the last one maybe shorter."""
    return [items[i : i + size] for i in range(0, len(items), size)]


@inputs([[1, 2], [3]], [], [[]], [[1], [2], [3]], [[1, 2, 3]], [[], [4, 5], []])
def flatten(lists):
    """Return one list of the elements of the lists in lists, in order."""
    result = []
    for inner in lists:
        for x in inner:
            result.append(x)
    return result


@inputs(
    (["a", "b"], [1, 2]), ([], []), (["x"], [9]), ([1, 2], [2, 1]), (["k", "k"], [1, 2]), ([0], [1])
)
def pairs_to_dict(keys, values):
    """Return a dict mapping each element of keys to the element of values at the same position."""
    return {keys[i]: values[i] for i in range(len(keys))}


@inputs({"a": 1, "b": 2}, {}, {"x": "y"}, {1: "one", 2: "two"}, {"k": 0}, {"a": "b", "b": "c"})
def invert_dict(d):
    """Return a dict mapping each value of d to its key (the values of d are distinct)."""
    return {v: k for k, v in d.items()}


@inputs(["a", "b", "a"], [], ["x"], ["a", "a", "a"], ["b", "a", "b", "c"], ["hi", "Hi"])
def word_counts(words):
    """Return a dict mapping each string in words to the number of times it occurs in words."""
    counts = {}
    for w in words:
        if w not in counts:
            counts[w] = 0
        counts[w] += 1
    return counts


@inputs(
    {"a": 1, "b": 3, "c": 2}, {"a": 2, "b": 2}, {}, {"x": 5}, {"a": -1, "b": -2}, {"a": 0, "b": 1}
)
def key_of_max(d):
    """Return the key of d with the largest value (the first on ties), or None if d is empty."""
    best = None
    for k in d:
        if best is None or d[k] > d[best]:
            best = k
    return best


@inputs(
    ({"a": 5, "b": 1}, {"b": 4}),
    ({"a": 2, "b": 3}, {"a": 1, "b": 2}),
    ({"a": 2}, {}),
    ({"x": 1}, {"x": 7}),
    ({"a": 2, "b": 3}, {"a": 3}),
    ({"a": 1, "b": 10}, {"a": 2, "b": 1}),
)
def total_price(prices, quantities):
    """Return the sum, over the items of quantities, of the item's quantity times its price."""
    total = 0
    for item in quantities:
        total += prices[item] * quantities[item]
    return total


@inputs([1, 1, 2, 1], [], [1], [1, 1, 1], [1, 2, 3], [2, 2, 3, 3, 2], ["a", "a", "b"])
def collapse_runs(items):
    """Return items with each run of equal neighbours cut to one element ([1, 1, 2] -> [1, 2])."""
    result = []
    for x in items:
        if not result or result[-1] != x:
            result.append(x)
    return result


@inputs([2, 1], [1, 2, 3], [1, 1, 2], [], [1], [1, 3, 2], [3, 2, 1], [1, 2, 2, 1])
def is_sorted(nums):
    """Return True if the numbers in nums never decrease from one to the next."""
    for i in range(len(nums) - 1):
        if nums[i] > nums[i + 1]:
            return False
    return True


@inputs([1, 4, 6], [], [5], [3, 3], [10, 5, 7], [0, -2, 2, 9])
def differences(nums):
    """Return the list of each number of nums minus the one before it ([1, 4, 6] -> [3, 2])."""
    return [nums[i] - nums[i - 1] for i in range(1, len(nums))]


@inputs(([1, 2, 3], 1), ([], 2), ([1, 2, 3], 4), ([1, 2, 3], 0), ([1, 2, 3], 3), ([1, 2, 3, 4], 2))
def rotate_right(items, k):
    """Return items rotated right by k places, k >= 0 ([1, 2, 3], 1 -> [3, 1, 2])."""
    if not items:
        return []
    k = k % len(items)
    return items[-k:] + items[:-k]


@inputs(
    ([0, 4, 8], 4, 4), ([1, 5, 10], 2, 8), ([], 0, 1), ([1, 2, 3], 1, 3), ([5], 6, 9), ([-3], -3, 2)
)
def count_in_range(nums, low, high):
    """Return how many numbers in nums lie between low and high, both included."""
    return sum(1 for x in nums if low <= x <= high)


@inputs([1, 2, 3, 4], [], [5], [2, 0, 3], [-1, 2], [1, 1, 1])
def product(nums):
    """Return the product of the numbers in nums (1 for an empty list)."""
    result = 1
    for x in nums:
        result *= x
    return result


@inputs(
    ([1, 2, 3], 5), ([1, 2, 3], 6), ([3, 3], 6), ([3], 6), ([], 0), ([1, -1, 4], 0), ([2, 7, 11], 9)
)
def has_pair_with_sum(nums, target):
    """Return True if two numbers at different positions of nums add up to target."""
    for i in range(len(nums)):
        for j in range(i + 1, len(nums)):
            if nums[i] + nums[j] == target:
                return True
    return False


@inputs((["a", "b"], "b"), ([1, 2, 3], 4), ([1, 2, 3], 2), ([], 1), ([5, 5], 5), ([0, 1], 0))
def index_of(items, target):
    """Return the position of the first element of items equal to target, or -1 if there is none."""
    for i in range(len(items)):
        if items[i] == target:
            return i
    return -1


@inputs([3, 1, 2], [1, 2, 3], [5], [3, 2, 1], [-1, -5, 0], [2, 2])
def min_and_max(nums):
    """Return the tuple (smallest, largest) of the numbers in the non-empty list nums."""
    low = nums[0]
    high = nums[0]
    for x in nums:
        low = min(low, x)
        high = max(high, x)
    return (low, high)


@inputs([1, 2, 3, 4], [], [2], [1], [0, -1, -2], [5, 7, 6])
def split_even_odd(nums):
    """Return a tuple of two lists: the even numbers of nums and the odd ones, in order."""
    evens = [x for x in nums if x % 2 == 0]
    odds = [x for x in nums if x % 2 != 0]
    return (evens, odds)


@inputs(
    ([1, 2, 3], [4, 5, 6]), ([], []), ([2], [3]), ([1, -1], [1, 1]), ([0, 2], [5, 3]), ([3], [2])
)
def dot_product(a, b):
    """Return the sum of the products of the elements at equal positions of the lists a and b."""
    return sum(a[i] * b[i] for i in range(len(a)))


@inputs([1, 1, 2], [1, 2, 3], [3, 2, 1], [], [5], [1, 3, 2, 4], [2, 2, 2])
def count_increases(nums):
    """Return how many numbers in nums are larger than the number before them."""
    count = 0
    for i in range(1, len(nums)):
        if nums[i] > nums[i - 1]:
            count += 1
    return count


@inputs([1, 2, 2, 3], [1, 2, 1, 2], ["a"], [3, 1, 1, 3, 3], ["x", "y", "y"], [7, 8, 9])
def most_frequent(items):
    """Return the element occurring most often in the non-empty items, the earliest on ties."""
    best = items[0]
    for x in items:
        if items.count(x) > items.count(best):
            best = x
    return best


@inputs(["a", "bb", "cc", "d"], [], ["hello"], ["x", "y"], ["ab", "c", "de", ""], ["one", "three"])
def group_by_length(words):
    """Return a dict mapping each length to the list of the strings of words of that length."""
    groups = {}
    for w in words:
        if len(w) not in groups:
            groups[len(w)] = []
        groups[len(w)].append(w)
    return groups


@inputs(
    ({"a": 1}, {"b": 2}),
    ({}, {}),
    ({"a": 1}, {"a": 2}),
    ({}, {"x": 0}),
    ({"a": 1, "b": 2}, {}),
    ({"a": 1, "b": 2}, {"b": 3, "c": 4}),
)
def merge_dicts(a, b):
    """Return a new dict with the items of a and b, b's value winning for a key in both."""
    result = dict(a)
    for k in b:
        result[k] = b[k]
    return result


@inputs(({"a": 1, "b": 5}, 3), ({"a": 3}, 3), ({}, 0), ({"a": 2}, 3), ({"x": -1}, 0), ({"a": 4}, 5))
def at_least(d, threshold):
    """Return a dict of the items of d whose value is at least threshold."""
    return {k: v for k, v in d.items() if v >= threshold}


@inputs([[1, 2], [3, 4]], [], [[]], [[5]], [[1, -1], [2]], [[1, 2, 3], [], [4]])
def matrix_sum(rows):
    """Return the sum of all numbers in the list of lists rows."""
    return sum(sum(row) for row in rows)


@inputs([[1, 2, 3]], [[1, 2], [3, 4]], [[1], [2], [3]], [[5]], [[1, 2], [3, 4], [5, 6]], [[0, 1]])
def transpose(matrix):
    """Return the transpose of matrix, a non-empty list of equally long non-empty lists."""
    return [[row[j] for row in matrix] for j in range(len(matrix[0]))]


@inputs([[0, 9], [9, 0]], [[1, 2], [3, 4]], [], [[5]], [[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[2]])
def diagonal_sum(matrix):
    """Return the sum of the numbers matrix[i][i] of the square list of lists matrix."""
    return sum(matrix[i][i] for i in range(len(matrix)))


@inputs([1, 2, -1, 3], [0, 1], [], [-1, 2], [3, 4, 5], [2, 0, 2], [1])
def leading_positives(nums):
    """Return the numbers of nums before the first one that is not positive."""
    result = []
    for x in nums:
        if x <= 0:
            break
        result.append(x)
    return result


@inputs([0, 10, 1], [], [5], [1, 2, 3, 4], [1, 1, 1], [-2, 2])
def count_above_average(nums):
    """Return how many numbers in nums are greater than their mean (0 for an empty list)."""
    if not nums:
        return 0
    mean = sum(nums) / len(nums)
    return len([x for x in nums if x > mean])


@inputs(([1, 2, 3, 4], 2), ([1, 2, 3], 3), ([1, 2, 3], 1), ([], 1), ([1, 2], 3), ([5, -1, 2, 0], 2))
def window_sums(nums, k):
    """Return the sums of every k consecutive numbers of nums, in order."""
    return [sum(nums[i : i + k]) for i in range(len(nums) - k + 1)]


@inputs([0, 1, 3], [1], [0], [3, 0, 1], [], [1, 2, 3, 4, 0, 6])
def missing_number(nums):
    """Return the one number from 0 to len(nums) inclusive that nums lacks."""
    n = len(nums)
    return n * (n + 1) // 2 - sum(nums)


@inputs(
    ([1, 1, 2], [1]), ([], [1]), ([1, 2, 3], [2, 3]), ([1, 2], []), ([3, 2, 1, 2], [2]), ([5], [5])
)
def common_elements(a, b):
    """Return the elements of a that also occur in b, in order, each only once."""
    result = []
    for x in a:
        if x in b and x not in result:
            result.append(x)
    return result


@inputs([1, 2, 3, 4, 5], [], [7], [1, 2], [0, 10, 20, 30], [-1, -2, -3])
def sum_even_positions(nums):
    """Return the sum of the numbers of nums at even positions (0, 2, 4, ...)."""
    return sum(nums[i] for i in range(0, len(nums), 2))


@inputs([1, 2, 3, 4], [], [5], [1, 2], [10, 1, 10], [-1, -2, -3])
def alternating_sum(nums):
    """Return nums[0] - nums[1] + nums[2] - nums[3] + ... (0 for an empty list)."""
    total = 0
    for i in range(len(nums)):
        total += nums[i] if i % 2 == 0 else -nums[i]
    return total


@inputs(
    ({"a": 5, "b": 2}, {"a": 3}),
    ({"a": 1}, {}),
    ({"x": 4, "y": 4}, {"x": 1, "y": 4}),
    ({"k": 0}, {"k": 2}),
    ({"a": 9, "b": 9}, {"b": 1}),
    ({"p": 3}, {"p": 3}),
)
def stock_after_sales(stock, sales):
    """Return a copy of the dict stock with the quantities of the dict sales subtracted."""
    result = dict(stock)
    for item in sales:
        result[item] -= sales[item]
    return result


@inputs(([3, 1, 2], 2), ([5, 4, 9], 1), ([], 2), ([1, 2, 3], 0), ([1, 2], 5), ([4, 4, 1, 7], 3))
def top_n(nums, n):
    """Return the n largest numbers of nums, largest first."""
    return sorted(nums, reverse=True)[:n]


@inputs(3, 0, 1, 2, 4, 6)
def pascal_row(n):
    """Return row n of Pascal's triangle, row 0 being [1]."""
    row = [1]
    for _ in range(n):
        row = [1] + [row[i] + row[i + 1] for i in range(len(row) - 1)] + [1]
    return row


@inputs([2, 4, 1, 10], [7, 6, 4, 3, 1], [1, 2], [7, 1, 5, 3, 6, 4], [], [5], [3, 3])
def best_profit(prices):
    """Return the largest prices[j] - prices[i] with i < j, or 0 if none is positive."""
    best = 0
    for i in range(len(prices)):
        for j in range(i + 1, len(prices)):
            best = max(best, prices[j] - prices[i])
    return best


BASICS: tuple[Basic, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Basic))
